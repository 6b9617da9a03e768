"""What the engine thread publishes about itself for other threads to read.

Across threads, publish, don't reach in: the engine thread builds an `EngineStats` after
each step (and after adds, aborts and idle waits) and swaps it in with one attribute
assignment; the HTTP thread (/load, admission, /metrics) reads only that snapshot, never
the scheduler's lists or the KV pool, which the engine thread mutates.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.step_model import StepFit


@dataclass(frozen=True)
class QueueSnapshot:
    """The waiting line and the room left, as the engine thread last left them."""

    waiting_tokens: list[int]  # prompt tokens still to compute per waiting request, in order
    num_running: int  # requests resident in the running batch
    max_num_seqs: int  # seats in the running batch
    free_kv_tokens: int  # free KV blocks x block size
    block_size: int  # tokens per KV block


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One immutable view of the engine, taken in its own thread. Counters are cumulative
    since the engine started; times are `time.monotonic()` seconds."""

    time_s: float  # when it was taken: the step heartbeat (no progress since then)
    num_steps: int  # engine steps run
    num_running: int  # requests resident in the running batch
    waiting_tokens: tuple[int, ...]  # tokens still to compute per waiting request, in order
    num_held: int  # n > 1 samples held until their first sample has its prompt KV
    max_num_seqs: int  # seats in the running batch
    block_size: int  # tokens per KV block
    kv_blocks_used: int  # blocks referenced by a request
    kv_blocks_free: int  # blocks free (evictable prefix-cache blocks included)
    kv_blocks_total: int
    prefix_cache_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # of those, tokens served from it
    num_preemptions: int  # requests preempted (recomputed) for lack of KV blocks
    num_failed_requests: int  # requests the engine failed alone
    num_generated_tokens: int  # output tokens sampled
    # Speculative decoding: draft tokens verified, and of those the ones the model agreed
    # with (kept; one cut short by a stop is counted all the same).
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # The capacity model (`workers.engine.step_model`): seats the ITL target allows now,
    # the fitted step cost (None until learned), recent mean step seconds, and the work
    # behind the seats: output tokens each running request may still generate (max_tokens
    # left), and each waiting request's max_tokens.
    seats: int = 0
    itl_target_s: float | None = None  # the scheduler's (engine.scheduler.itl_target_s)
    step_fit: StepFit | None = None
    recent_step_s: float | None = None
    decode_step_s: float | None = None  # predicted, with `seats` decoding
    prefill_tokens_per_s: float | None = None  # predicted, beside the running batch
    running_remaining: tuple[int, ...] = ()
    running_prefill_tokens: int = 0  # prompt tokens the running requests have yet to compute
    waiting_max_tokens: tuple[int, ...] = ()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_tokens)

    @property
    def has_unfinished(self) -> bool:
        """Whether any request was resident, waiting or held when this was taken."""
        return bool(self.num_running or self.waiting_tokens or self.num_held)

    @property
    def free_kv_tokens(self) -> int:
        return self.kv_blocks_free * self.block_size

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by a request (0-1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def queue(self, arrivals: Sequence[int] = ()) -> QueueSnapshot:
        """The waiting line for admission, with `arrivals` (prompt tokens of requests
        handed in and not yet in this snapshot) behind it, in order."""
        return QueueSnapshot(
            waiting_tokens=[*self.waiting_tokens, *arrivals],
            num_running=self.num_running,
            max_num_seqs=self.seats or self.max_num_seqs,
            free_kv_tokens=self.free_kv_tokens,
            block_size=self.block_size,
        )
