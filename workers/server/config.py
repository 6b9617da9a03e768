"""The worker process's settings, and whether they expose its control endpoints."""

import ipaddress
from dataclasses import dataclass, field

from workers.api.validation import RequestLimits


@dataclass
class WorkerConfig:
    """Worker process settings; `switchyard worker` fills it from YAML."""

    served_model_names: list[str] = field(default_factory=list)  # first is reported
    # The short waiting line; beyond it: 503. Requests that fit the running batch and
    # the free KV (admitted within a step or two) do not count against it.
    max_waiting_requests: int = 32
    max_waiting_prompt_tokens: int = 65536
    retry_after_s: float = 1.0  # base of Retry-After on 503; jitter is added
    retry_after_jitter_s: float = 2.0
    # With work resident, no engine step for this long is a slow step while the engine
    # thread uses CPU, a stall when it does not (blocked: workers/server/stall.py) ...
    stall_timeout_s: float = 5.0
    stall_hard_timeout_s: float = 120.0  # ... and a stall past this, CPU or not
    sse_heartbeat_s: float = 5.0  # SSE comment while a stream waits for its first token
    default_max_tokens: int = 256
    exit_when_drained: bool = False
    # A drain lets what runs finish for this long, then hands over the streams a resuming
    # gateway can continue (those that asked for `return_token_ids`): each ends with an
    # in-band `handed_over` error, and the gateway goes on with it on another replica at
    # the exact token (gateway/serving/resume.py). The rest still run to their end.
    # None: wait for every request, however long. `POST /drain` may set its own.
    drain_grace_s: float | None = 10.0
    limits: RequestLimits = field(default_factory=RequestLimits)  # per-request bounds
    # `Authorization: Bearer <control_key>` on control endpoints (/drain); None = open,
    # which the entry point allows only on a loopback host (see `control_exposure_error`).
    control_key: str | None = None
    # When the engine thread dies (a failure no request explains), fail what is in
    # flight and exit non-zero so a supervisor restarts the process.
    exit_on_engine_failure: bool = True
    failure_exit_delay_s: float = 1.0  # /ready answers `stalled` this long before that exit


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def control_exposure_error(host: str, control_key: str | None, insecure: bool) -> str | None:
    """Why a worker must not start like this (control endpoints open to the network)."""
    if control_key or insecure or is_loopback(host):
        return None
    return (
        f"the worker would listen on {host} with /drain open to anyone: set a control key "
        "(worker.control_key, --control-key or SWITCHYARD_WORKER_CONTROL_KEY), or pass "
        "--insecure-control"
    )
