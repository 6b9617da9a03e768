"""Why a pool refused a request before any token: the queue over a bound (`QueueFull`), no
replica to take it (`NoReplica`), its TTFT target out of reach (`OverCapacity`), or its
deadline passed (`DeadlineExceeded`). `gateway.errors` maps each to its status and
Retry-After."""

import math


class QueueFull(Exception):
    """The pool's queue is over a bound; the client should retry after `retry_after_s`.

    `reason` is "requests" or "tokens" (which bound); `retry_after_s` is jittered so
    refused clients do not come back as one wave.
    """

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"admission queue full ({reason}); retry after {retry_after_s:.2f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


class NoReplica(Exception):
    """No replica of the pool has room for this request now (all busy, draining, down or
    already tried), or the pool has no live replica at all (`gateway.capacity.balancer.is_live`):
    the client may retry after `retry_after_s`."""

    def __init__(self, pool: str, retry_after_s: float = 1.0, why: str = "could take") -> None:
        super().__init__(f"no replica of {pool} {why} the request")
        self.pool = pool
        self.retry_after_s = retry_after_s


class OverCapacity(Exception):
    """The pool cannot give this request its first token within its TTFT target now:
    refused at arrival (`predicted_s`: the predicted TTFT; the capacity model,
    `gateway.capacity.predictor`), or while it waited (its latest start passed:
    `predicted_s` is None). The client may retry after `retry_after_s`. `headroom`: the
    share of the target admission kept back (`Pool.ttft_headroom`)."""

    def __init__(
        self,
        pool: str,
        predicted_s: float | None,
        target_s: float,
        retry_after_s: float,
        headroom: float = 0.0,
    ) -> None:
        if predicted_s is None:
            why = "it could not start in time to meet"
        elif math.isfinite(predicted_s):
            why = f"its first token is predicted after {predicted_s:.2f} s, past"
        else:
            why = "no replica can take it within"
        target = f"the TTFT target of {target_s:.2f} s"
        if headroom:
            target = f"{target_s * (1 - headroom):.2f} s ({target} less {headroom:.0%} headroom)"
        super().__init__(f"{pool} is over capacity: {why} {target}")
        self.pool = pool
        self.predicted_s = predicted_s
        self.target_s = target_s
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The request's deadline passed. `stage` says where: "queue" (it waited behind others
    and was never dispatched: overload), "start" (it was already past when it arrived), or
    "dispatch" (a worker had it and did not answer in time)."""

    def __init__(
        self, request_id: str, deadline: float, waited_s: float, stage: str = "queue"
    ) -> None:
        super().__init__(f"request {request_id} missed its deadline ({stage}, {waited_s:.3f} s)")
        self.request_id = request_id
        self.deadline = deadline
        self.waited_s = waited_s
        self.stage = stage
