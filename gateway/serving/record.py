"""What the gateway reports of one public request: its `RequestRecord` (the access line and
the request metrics) and, once a flight settled it, its `Outcome` (the usage record and the
tenant metrics)."""

import time
from dataclasses import dataclass

from quota.usage import AutoCost, UsagePart


@dataclass(slots=True)
class RequestRecord:
    """One public request as the access line and the metrics report it, filled in as it
    goes: arrival by the handler, the caller and the plan by intake, the status by whoever
    answers, the final status and the tokens by the flight's settlement."""

    path: str
    arrived_at: float  # time.perf_counter() at arrival
    tenant: str = "-"  # "-": not authenticated
    key_id: str | None = None  # the API key's id
    pool: str = "-"  # the plan's pool; "-": refused before it was planned
    route: str = "-"  # the plan's route
    # The answer's HTTP status; on a committed stream, an in-band error's; at settlement,
    # 499 for a client gone mid-answer. None: no answer began (the client left first).
    status: int | None = None
    answered_at: float | None = None  # perf_counter when the answer began (a stream: committed)
    tokens: int = 0  # charged to the tenant, set at settlement
    resumes: int = 0  # times its stream went on on another replica (gateway/serving/resume.py)
    # A stream's first token, seconds from arrival, and what admission predicted for it.
    first_token_s: float | None = None
    predicted_ttft_s: float | None = None

    def answer(self, status: int) -> None:
        """The answer begins with `status`."""
        self.status = status
        self.answered_at = time.perf_counter()


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a settled request ended, for its usage record and metrics."""

    key_id: str | None  # the API key's id (usage by key)
    model: str  # the pool that answered (the last attempt a worker accepted)
    route: str  # the plan's route, or "escalated" when a second attempt answered
    status: int  # HTTP status, or the in-band error's; 499 for a client gone mid-answer
    latency_ms: int  # arrival to settlement
    parts: tuple[UsagePart, ...]  # tokens (and cost) per attempt a worker accepted
    auto: AutoCost | None = None  # an `auto` request's cost beside each pool's (None: not auto)
