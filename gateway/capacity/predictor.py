"""When would a request get its first token? A pure function of what the fleet measures.

Admission asks this at arrival and refuses what cannot meet the pool's TTFT target, so
a request it accepts either starts in time or is refused before any token (its queue
turn has a latest start, `Ticket.start_by`). No clock, no I/O: the pool gathers the
signals (`gateway.capacity.pool.Pool.capacity`), this module only reasons over them.

The model: each replica has `seats` (the running batch its ITL target allows, from its
/load), some occupied. An occupied seat frees when its sequence has generated what it
still may (max_tokens left, times the pool's measured completion ratio) at the replica's
decode step time; a free seat of a replica still starting frees when it is ready. The
requests ahead of ours (in fair-queue order) take the earliest free seat in turn and
hold it for their prefill plus their expected decode. Prefill is one line per replica:
a prompt is computed (at the replica's measured prefill rate) after the prompts it
already has and those given to it before, so a burst of long prompts on one replica
waits for each other even with seats free. Ours takes the next seat: its first token
comes after its prefill and one step. Work is counted in tokens, not requests: a seat
held by a 2,000 token answer frees much later than one held by a 10 token answer.
"""

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """One replica as admission sees it. Times in seconds from now."""

    seats: int  # sequences its running batch may hold within its ITL target
    occupied_s: tuple[float, ...]  # per occupied seat: when it is expected to free
    decode_step_s: float  # seconds per output token of a sequence in a full batch
    prefill_tokens_per_s: float  # prompt tokens it computes per second beside its batch
    ready_in_s: float = 0.0  # > 0: still starting; its seats are free from then
    # Seconds of prompt tokens it has yet to prefill (its running prompts' rest and its
    # waiting line): prefill is one line per replica, so a new prompt's starts after them.
    prefill_backlog_s: float = 0.0

    def service_s(self, work: "Work") -> float:
        """How long `work` holds a seat here: its prefill, then its decode."""
        return self.prefill_s(work) + work.output_tokens * self.decode_step_s

    def prefill_s(self, work: "Work") -> float:
        return work.prompt_tokens / self.prefill_tokens_per_s

    def first_token_s(self, work: "Work") -> float:
        """From taking a seat to the first token: its prefill, then one step."""
        return self.prefill_s(work) + self.decode_step_s


@dataclass(frozen=True, slots=True)
class Work:
    """A request's size: its prompt, and the output tokens it is expected to generate."""

    prompt_tokens: int
    output_tokens: float


@dataclass(frozen=True, slots=True)
class Prediction:
    """When a request would take a seat (`start_s`) and get its first token (`ttft_s`),
    in seconds from now; `first_token_s` is the part after the start (its own prefill
    and a step). Inf with no replica to serve it."""

    start_s: float
    ttft_s: float
    first_token_s: float

    @property
    def known(self) -> bool:
        return math.isfinite(self.ttft_s)


NEVER = Prediction(math.inf, math.inf, math.inf)


def predict(replicas: Sequence[ReplicaCapacity], ahead: Sequence[Work], work: Work) -> Prediction:
    """When `work` would start and get its first token behind `ahead` (in the order
    they will be dispatched) on `replicas`."""
    seats: list[tuple[float, int]] = []  # (free at, replica index): a heap
    prefill_free = [r.ready_in_s + r.prefill_backlog_s for r in replicas]
    for i, replica in enumerate(replicas):
        if replica.seats <= 0 or replica.prefill_tokens_per_s <= 0:
            continue
        occupied = sorted(replica.occupied_s)
        num_free = max(0, replica.seats - len(occupied))
        seats.extend((replica.ready_in_s, i) for _ in range(num_free))
        # More occupants than seats (the batch shrank, or the report lags): the excess
        # frees no seat of its own; the seats are those that free first.
        seats.extend((max(t, replica.ready_in_s), i) for t in occupied[: replica.seats])
    if not seats:
        return NEVER
    heapq.heapify(seats)
    for before in ahead:
        free_at, i = heapq.heappop(seats)
        replica = replicas[i]
        prefilled = max(free_at, prefill_free[i]) + replica.prefill_s(before)
        prefill_free[i] = prefilled
        heapq.heappush(seats, (prefilled + before.output_tokens * replica.decode_step_s, i))
    # Ours: of the seats free earliest on each replica, the earliest first token.
    best: tuple[float, float] | None = None  # (first token, start)
    earliest: dict[int, float] = {}
    for free_at, i in seats:
        earliest[i] = min(free_at, earliest.get(i, math.inf))
    for i, start in earliest.items():
        replica = replicas[i]
        first = max(start, prefill_free[i]) + replica.first_token_s(work)
        if best is None or first < best[0]:
            best = (first, start)
    assert best is not None
    first, start = best
    return Prediction(start, first, first - start)


def retry_after_s(prediction: Prediction, target_s: float, floor_s: float, cap_s: float) -> float:
    """How long a refused client should wait: until the work ahead would have drained
    enough for a request arriving then to meet `target_s` (its predicted excess over the
    target), within [floor_s, cap_s]. The caller adds jitter."""
    excess = prediction.ttft_s - target_s
    if not math.isfinite(excess):
        return cap_s
    return min(cap_s, max(floor_s, excess))
