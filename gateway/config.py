"""Gateway settings: one dataclass, defaults here, filled from YAML by `switchyard gateway`."""

from dataclasses import dataclass, field

from workers.api.upstreams.base import KINDS
from workers.api.validation import RequestLimits

UPSTREAM_KINDS = (*KINDS, "auto")


@dataclass
class UpstreamConfig:
    """What kind of server a pool's members are, and how to talk to them. A pool without
    one is Switchyard workers (`kind: switchyard`, polled on `/load`)."""

    kind: str = "switchyard"  # one of UPSTREAM_KINDS; auto: detected per member, logged
    # The upstream's API key (sent as `Authorization: Bearer`): the name of an environment
    # variable, or a file holding it. Never logged, shown by /admin or the dashboard.
    api_key_env: str | None = None
    api_key_file: str | None = None
    model: str | None = None  # the model name sent upstream; None: the pool's name
    # Requests one member runs at once; None: what the server says (llama-server's slots),
    # else the gateway's max_inflight_per_worker. A hosted API's concurrency limit goes here.
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None  # the provider's token budget for the whole pool
    context_length: int | None = None  # when the server does not say (hosted APIs)


@dataclass
class MembershipConfig:
    """Pool members from the fleet's Redis (workers/api/membership.py): workers that ran
    `switchyard worker --join`, and the local replicas of `switchyard serve` supervisors
    on other hosts. A configured pool takes every live member announced under its name,
    beside its static `urls`; names no configured pool has are ignored."""

    enabled: bool = False
    redis_url: str | None = None  # None: the gateway's own Redis (quotas, keys)
    # A member's record lives ttl_s past its last heartbeat (members heartbeat every
    # ttl_s / 3). The gateway re-reads every poll_s, and at once on a change message, so
    # a member that dies without withdrawing leaves the rotation within ttl_s + poll_s.
    # Each member sets its own TTL where it announces (`worker --join-ttl`; a `serve`
    # supervisor's replicas take this one); /admin/fleet shows ttl_s + poll_s as the bound.
    ttl_s: float = 6.0
    poll_s: float = 1.0
    # Pools that take members from Redis; None: every configured pool.
    pools: list[str] | None = None
    # Per pool, the model fingerprint its members must have; a pool not named takes the
    # one Redis holds (set by its first member). Members of another model are refused.
    fingerprints: dict[str, str] = field(default_factory=dict)


@dataclass
class GatewayConfig:
    """Everything the gateway process needs; pools map a pool name to worker URLs."""

    pools: dict[str, list[str]] = field(default_factory=dict)
    # Members announced in the fleet's Redis join the pools too (off: static URLs only).
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    # Per pool, the kind of server its members are (gateway/upstreams); default switchyard.
    upstreams: dict[str, UpstreamConfig] = field(default_factory=dict)
    # Local tokenizer directory (or tokenizer.json) per pool, to count prompt tokens the
    # way the target model does. A pool without one is estimated at 1 token per 3 bytes.
    tokenizers: dict[str, str] = field(default_factory=dict)
    default_pool: str | None = None  # where `model: auto` goes until the cascade decides
    # What each pool charges (gateway/billing/prices.py PoolPrice fields: per million
    # prompt, cached and completion tokens, or per compute-second); a pool not named is
    # free. `PUT /admin/prices` replaces them at runtime (audited). Amounts in `currency`.
    prices: dict[str, dict] = field(default_factory=dict)
    currency: str = "USD"
    # Where a tenant's (or key's) crossing of its soft budget is POSTed, once per period;
    # None: only the metric and the log say so.
    budget_webhook_url: str | None = None
    redis_url: str | None = None  # None: an embedded Redis persisted under data_dir
    data_dir: str = "data"
    admin_key: str | None = None  # also from SWITCHYARD_ADMIN_KEY (read by the CLI)
    default_max_tokens: int = 256  # injected when a request has no max_tokens
    max_tokens_cap: int = 4096  # larger max_tokens are refused
    request_timeout_s: float = 120.0  # deadline unless the `x-request-timeout` header says
    max_body_bytes: int = 1024 * 1024
    # How long a stored Responses API response (`store: true`, its default) is kept in Redis
    # for `GET /v1/responses/{id}` and `previous_response_id`: 30 days, as OpenAI keeps them.
    responses_retention_s: int = 30 * 86_400
    load_poll_interval_s: float = 0.2
    # A ready foreign member (another kind of server) is probed this often (several GETs and
    # a parse each); one not ready yet every load poll. A hosted API every 5 s.
    foreign_probe_interval_s: float = 1.0
    max_inflight_per_worker: int = 32
    queue_max_requests: int = 256
    # Longest wait for a turn in the queue (503 + Retry-After past it); None: only the
    # request's deadline. Set it near the unloaded TTFT to keep accepted requests prompt.
    queue_max_wait_s: float | None = None
    queue_reserve_fraction: float = 0.125  # slots kept for tenants under their fair share
    # Latency targets (gateway/capacity/predictor.py): per pool, the time to first token a
    # request it accepts must get. Admission predicts each request's TTFT from what the
    # replicas measure (seats, step time, prefill rate, the work ahead in tokens, replicas
    # still starting) and refuses at once (503 over_capacity, Retry-After from the
    # prediction) what would miss it; a request it queues is refused before any token if
    # its latest start passes. A pool not named here: counts and deadlines only. The ITL
    # target is the workers' (engine.scheduler.itl_target_s bounds their batch).
    ttft_target_s: dict[str, float] = field(default_factory=dict)
    # The share of each TTFT target admission keeps back for what its prediction leaves
    # out (clients, relays and the gateway sharing cores in a burst): a request is accepted
    # only when predicted within target x (1 - ttft_headroom).
    ttft_headroom: float = 0.1
    # A request's `priority` (lower is more urgent) scales its pool's TTFT target; one
    # outside these takes the nearest. A tenant may ask no more urgency than its limits'
    # `priority_ceiling` (default 0).
    priority_ttft_scale: dict[int, float] = field(
        default_factory=lambda: {-1: 0.5, 0: 1.0, 1: 2.0, 2: 4.0}
    )
    # How long a replica takes from joining to ready, until the pool has measured one.
    replica_start_estimate_s: float = 30.0
    # A worker back from a stall (gateway/capacity/flaps.py) rejoins the rotation only
    # after reporting ready this long in a row; the hold doubles with each stall within
    # flap_reset_s of the last, up to stall_hold_max_s.
    stall_hold_s: float = 2.0
    stall_hold_max_s: float = 30.0
    flap_reset_s: float = 60.0
    # This process's share of each replica's seats (1/N in a group of N; set by the group).
    seat_share: float = 1.0
    # The door (gateway/capacity/door.py): with several tenants active, those over their share of
    # the last door_window_s's admissions are held to a number of requests in flight that
    # halves while the others' latency (arrival to reservation) is door_tolerance_s over
    # the gateway's floor; the rest wait in their tenant's lane, refused (429
    # gateway_busy) past door_max_wait_s or door_lane_max waiting. False: no door.
    door: bool = True
    door_window_s: float = 1.0
    door_tolerance_s: float = 0.001
    door_max_wait_s: float = 2.0
    door_lane_max: int = 1024  # waiting requests per tenant, per process
    door_refusal_delay_s: float = 0.25  # a door refusal is held this long (a tarpit)
    queue_max_tokens: int = 262144
    queue_quantum_tokens: int = 256  # DRR credit per tenant visit (gateway/capacity/admission.py)
    retry_after_s: float = 1.0
    retry_after_jitter_s: float = 1.0
    dispatch_attempts: int = 3  # tries across replicas before the first token
    worker_retry_after_cap_s: float = 2.0  # longest a worker's Retry-After is honoured
    sse_heartbeat_s: float = 5.0  # SSE comment while a stream waits; refusals before: real status
    first_byte_timeout_s: float = 10.0  # a streaming worker that sends no status by then is hung
    stream_idle_timeout_s: float = 30.0  # a stream silent this long (heartbeats count) is cut
    # A stream whose Switchyard worker fails mid-answer goes on on another replica at the
    # exact token, at most this many times (gateway/serving/resume.py); 0: it ends in-band.
    stream_resumes: int = 2
    body_timeout_s: float = 10.0  # a request body must arrive within this (slow clients: 408)
    header_timeout_s: float = 10.0  # a connection must send its request head within this
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    shutdown_grace_s: float = 30.0  # after SIGTERM, requests still running then are cancelled
    # Gateway processes on one port (SO_REUSEPORT; `switchyard gateway --workers N`). Each
    # gets 1/N of max_inflight_per_worker, queue_max_requests and queue_max_tokens.
    processes: int = 1
    # Bounds on what one request may ask (stop strings, logprobs, messages, nesting, ...).
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    # The cascade router for `model: auto` (both pools set = enabled).
    cascade_small_pool: str | None = None
    cascade_large_pool: str | None = None
    classifier_path: str | None = None  # None: the artifact shipped in cascade/artifacts
    routing_poll_s: float = 0.5  # how often replicas look for a new routing version
    known_key_ttl_s: float = 300.0  # how long a key stays usable through a Redis outage
    # A key that authenticated this recently is not looked up in Redis again: revoking it,
    # its expiry, or a change of its (or its tenant's) limits applies within this. 0: every
    # request reads the key and its tenant from Redis (two round trips).
    key_cache_ttl_s: float = 1.0
    # Redis unreachable: per limit class "open" (serve unchecked) or "closed" (503).
    quota_heartbeat_ttl_s: float = 5.0  # a gateway silent this long is dead: its slots freed
    quota_sweep_interval_s: float = 1.0  # journal replay and dead-gateway sweeps
    # Usage history (quota/usage.py): hourly buckets, daily buckets, recent-request log lines.
    usage_hour_retention_s: int = 8 * 86_400
    usage_day_retention_s: int = 400 * 86_400
    usage_recent_max: int = 200
    # Metrics: tenants that always get their own `tenant` label; up to the cap more, first
    # come; the rest are `other` (bounded label cardinality).
    metrics_tenants: list[str] = field(default_factory=list)
    metrics_tenant_cap: int = 20
    # /metrics names tenants and their traffic: it answers peers in metrics_networks
    # (CIDRs; default loopback) and requests with `Authorization: Bearer <metrics_token>`,
    # and is a 401 to anyone else. A token with metrics_networks: [] is the token only.
    metrics_token: str | None = None
    metrics_networks: list[str] = field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    fail_tokens: str = "open"
    fail_requests: str = "open"
    fail_concurrency: str = "open"
    fail_budget: str = "open"  # a hard money budget (quota.budget)
    # A pool member that has not answered a poll since it joined counts as starting (its
    # server not listening yet) for this long; after that, silent is lost. While no member
    # of a pool is ready, loading or starting, its requests are refused at once (503,
    # Retry-After) instead of waiting out their deadline in the queue.
    replica_start_grace_s: float = 30.0
    # Prompt counting (gateway/serving/prompt_tokens.py): a request body over
    # count_inline_bytes is counted on one of count_threads threads, at most
    # count_per_tenant of one tenant's at a time; up to count_lane_max more of a tenant's
    # wait their turn (round-robin across tenants), the rest are refused (429 gateway_busy).
    count_inline_bytes: int = 16384
    count_threads: int = 2
    count_per_tenant: int = 1
    count_lane_max: int = 64
    # A worker's answer is untrusted input (gateway/serving/attempts.py, relay.py,
    # workers/api/http1.py). Its status line and headers: at most upstream_max_head_bytes
    # (else the try fails and moves to another replica). A whole body, or a stream's bytes
    # in all: at most upstream_min_answer_bytes + upstream_bytes_per_token per token the
    # request may produce (n * max_tokens, plus the prompt per sample when echoed); past
    # it, 502 (in-band on a stream). 4 KiB a token covers a chat token with 20 top
    # logprobs; the default request (256 tokens) may take 2 MiB.
    upstream_max_head_bytes: int = 65536
    upstream_min_answer_bytes: int = 1 << 20
    upstream_bytes_per_token: int = 4096
    # A non-streaming request waiting on a worker that the poller (or a first-byte timeout)
    # sees unreachable keeps waiting while anything comes from that worker (a poll answer,
    # a byte on any of its connections): a worker busy building a large answer is slow,
    # not lost. Silent this long, it is lost: the request moves to another replica.
    worker_lost_after_s: float = 5.0


def split_pool_entries(section: dict) -> dict:
    """A gateway section from YAML whose `pools` may give, per pool, either its member
    URLs (a list) or a mapping with `urls` and the pool's upstream settings (`kind`,
    `api_key_env`, ...): the section with the lists in `pools` and the settings in
    `upstreams`, as `GatewayConfig` takes them."""
    pools = section.get("pools")
    if not isinstance(pools, dict):
        return section
    out = dict(section)
    out["pools"], upstreams = {}, dict(section.get("upstreams") or {})
    for name, entry in pools.items():
        if isinstance(entry, dict):
            entry = dict(entry)
            urls = entry.pop("urls", [])
            if name in upstreams:
                raise ValueError(f"pool {name!r}: its settings are both in pools and upstreams")
            upstreams[name] = entry
            entry = urls
        out["pools"][name] = entry
    if upstreams:
        out["upstreams"] = upstreams
    return out
