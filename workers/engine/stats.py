"""What the engine thread publishes about itself for other threads to read."""

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueSnapshot:
    """The waiting line and the room left, as the engine thread last left them."""

    waiting_tokens: list[int]  # prompt tokens still to compute per waiting request, in order
    num_running: int  # requests resident in the running batch
    max_num_seqs: int  # seats in the running batch
    free_kv_tokens: int  # free KV blocks x block size
    block_size: int  # tokens per KV block
