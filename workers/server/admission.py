"""Worker admission as a pure function: which waiting requests count against the line.

A request that will be admitted at the next step or two (a seat is free in the running
batch and its prompt fits the free KV blocks) is not really queued: counting it against
`max_waiting_requests` refused the later half of a 64-request burst on a worker that
could batch all 64. Only what does not fit counts.
"""

from dataclasses import dataclass

from workers.engine.stats import QueueSnapshot


@dataclass(frozen=True)
class Backlog:
    """What of the waiting line cannot be admitted soon."""

    num_requests: int  # waiting requests that do not fit the running batch and KV
    num_tokens: int  # their prompt tokens
    fits: bool  # whether one more request of the asked size would fit right away


def backlog(snap: QueueSnapshot, num_new_tokens: int) -> Backlog:
    """Walk the line in order, seating requests while seats and KV last.

    The scheduler admits strictly in order, so once one request does not fit, every
    request behind it waits too and counts. `fits` says whether a new request of
    `num_new_tokens` prompt tokens would be seated behind the line.
    """
    seats = snap.max_num_seqs - snap.num_running
    kv_left = snap.free_kv_tokens
    bs = max(snap.block_size, 1)
    blocked = False
    num_requests = num_tokens = 0
    for tokens in snap.waiting_tokens:
        need = -(-max(tokens, 1) // bs) * bs
        if not blocked and seats > 0 and need <= kv_left:
            seats -= 1
            kv_left -= need
            continue
        blocked = True
        num_requests += 1
        num_tokens += tokens
    need = -(-max(num_new_tokens, 1) // bs) * bs
    return Backlog(num_requests, num_tokens, not blocked and seats > 0 and need <= kv_left)
