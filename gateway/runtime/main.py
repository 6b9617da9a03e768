"""The gateway process: connect Redis (or start an embedded one), build, serve; or, with
`processes > 1`, one member of a group on one port (gateway/runtime/group.py)."""

import logging
import os
import random
import signal
import socket
import sys
from pathlib import Path

from litestar import Litestar
from prometheus_client import CollectorRegistry

from gateway.app import create_gateway_app
from gateway.capacity.demand import DemandPublisher
from gateway.capacity.door import Gate
from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.flaps import FlapPolicy
from gateway.capacity.membership import MembershipWatcher
from gateway.capacity.pool import Pool
from gateway.config import GatewayConfig, UpstreamConfig
from gateway.gateway import Gateway
from gateway.learning.classifiers import ClassifierRegistry
from gateway.learning.label_store import LabelStore
from gateway.learning.learner import Learner
from gateway.learning.router import Router, RoutingMetrics
from gateway.learning.shadow_budget import ShadowBudget
from gateway.metrics import GatewayMetrics, TenantLabels
from gateway.runtime.embedded_redis import EmbeddedRedis
from gateway.runtime.group import MemberSpec, serve_processes
from gateway.runtime.group_metrics import ProcessMetrics
from gateway.runtime.http_server import GatewayServer, reuse_port_socket, server_config
from gateway.serving.prompt_tokens import PromptCounter, load_tokenizer
from gateway.upstream_keys import check_upstreams, upstream_headers
from quota.connection import make_redis
from quota.journal import ReconcileJournal, journal_path
from quota.limiter import FailurePolicy, QuotaLimiter
from quota.pipelined import PipelinedRedis
from quota.store import TenantStore
from quota.sweeper import QuotaMaintenance, new_owner_id
from quota.usage import UsageConfig, UsageReader
from workers.api.client import WorkerClient
from workers.api.demand_store import DemandStore
from workers.api.membership_store import MembershipStore, membership_redis
from workers.api.upstreams.registry import adapter_for

log = logging.getLogger(__name__)


def build_gateway(
    config: GatewayConfig, redis_url: str, rng: random.Random | None = None
) -> Gateway:
    """All collaborators of one gateway process, against the Redis at `redis_url`."""
    if not config.pools:
        raise ValueError("the gateway needs at least one pool (pools: {name: [worker URLs]})")
    # The pool's connections retry (fast, jittered) and are health-checked, so a Redis
    # restart heals without a person; an unreachable Redis still becomes a fail-open or
    # fail-closed decision within a request's budget (quota.connection.retry_bound_s).
    redis = make_redis(redis_url)
    registry = CollectorRegistry()
    # Whole-request timeouts are the request's deadline (dispatch) and the stream's idle
    # bound (relay); the client bounds only connecting.
    workers = WorkerClient(
        first_byte_timeout_s=config.first_byte_timeout_s,
        max_head_bytes=config.upstream_max_head_bytes,
    )
    queue = QueueConfig(
        max_requests=config.queue_max_requests,
        max_wait_s=config.queue_max_wait_s,
        reserve_fraction=config.queue_reserve_fraction,
        max_tokens=config.queue_max_tokens,
        quantum_tokens=config.queue_quantum_tokens,
        retry_after_s=config.retry_after_s,
        retry_after_jitter_s=config.retry_after_jitter_s,
    )
    check_upstreams(config)
    if not 0.0 <= config.ttft_headroom < 1.0:
        raise ValueError(f"ttft_headroom must be in [0, 1), got {config.ttft_headroom}")
    pools = {}
    for name, urls in config.pools.items():
        up = config.upstreams.get(name) or UpstreamConfig()
        pools[name] = Pool(
            name,
            urls,
            workers,
            queue,
            config.max_inflight_per_worker,
            start_grace_s=config.replica_start_grace_s,
            ttft_target_s=config.ttft_target_s.get(name),
            seat_share=config.seat_share,
            start_estimate_s=config.replica_start_estimate_s,
            priority_ttft_scale={int(k): v for k, v in config.priority_ttft_scale.items()},
            flap_policy=FlapPolicy(
                config.stall_hold_s, config.stall_hold_max_s, config.flap_reset_s
            ),
            kind=up.kind,
            upstream_model=up.model,
            max_concurrency=up.max_concurrency,
            context_length=up.context_length,
            upstream_headers=upstream_headers(name, up),
            foreign_probe_interval_s=config.foreign_probe_interval_s,
            tokens_per_minute=up.tokens_per_minute,
            ttft_headroom=config.ttft_headroom,
        )
        if up.kind != "switchyard":
            log.info(
                "pool %s: %s servers%s", name, up.kind, f", model {up.model}" if up.model else ""
            )
    tokenizers = {pool: load_tokenizer(path) for pool, path in config.tokenizers.items()}
    policy = FailurePolicy(
        tokens=config.fail_tokens,
        requests=config.fail_requests,
        concurrency=config.fail_concurrency,
        budget=config.fail_budget,
    )
    router = learner = None
    if config.cascade_small_pool and config.cascade_large_pool:
        router = _build_router(config, redis, registry, pools)
        learner = Learner(LabelStore(redis), registry, rng, budget=ShadowBudget(redis))
    # This process is one quota owner: reservations are indexed under its id, its journal
    # keeps the settlements Redis missed, and its maintenance task settles them (and those
    # of dead gateways) once Redis answers.
    owner_id = new_owner_id()
    journal = ReconcileJournal(journal_path(Path(config.data_dir) / "quota-journal", owner_id))
    usage = UsageConfig(
        hour_retention_s=config.usage_hour_retention_s,
        day_retention_s=config.usage_day_retention_s,
        recent_max=config.usage_recent_max,
    )
    limiter = QuotaLimiter(
        redis,
        policy,
        registry,
        owner_id=owner_id,
        journal=journal,
        usage=usage,
        pipelined=PipelinedRedis(redis_url),  # reserve and reconcile: once per request each
    )
    maintenance = QuotaMaintenance(
        limiter, heartbeat_ttl_s=config.quota_heartbeat_ttl_s, registry=registry
    )
    metrics = GatewayMetrics(
        registry, TenantLabels(config.metrics_tenants, config.metrics_tenant_cap)
    )
    metrics.watch_pools(lambda: pools)
    gate = None
    if config.door:
        gate = Gate(
            tolerance_s=config.door_tolerance_s,
            lane_max=config.door_lane_max,
            max_wait_s=config.door_max_wait_s,
            window_s=config.door_window_s,
        )
    membership = None
    demand = None
    if config.membership.enabled:
        members_redis = membership_redis(config.membership.redis_url or redis_url)
        membership = MembershipWatcher(
            MembershipStore(members_redis), pools, config.membership, registry
        )
        # The fleet's leader reads it (workers.api.demand); the same Redis as membership.
        demand = DemandPublisher(
            DemandStore(members_redis),
            {n: pools[n] for n in membership.watched},
            interval_s=config.membership.poll_s,
            ttl_s=max(config.membership.ttl_s, 3 * config.membership.poll_s),
        )
        log.info(
            "pools %s take members from the fleet's Redis (gone within %g s of a death)",
            membership.watched,
            membership.staleness_bound_s,
        )
    return Gateway(
        membership=membership,
        demand=demand,
        router=router,
        usage=UsageReader(redis, usage),
        learner=learner,
        config=config,
        store=TenantStore(redis),
        limiter=limiter,
        maintenance=maintenance,
        pools=pools,
        counter=PromptCounter(tokenizers),
        workers=workers,
        registry=registry,
        redis=redis,
        rng=rng or random.Random(),
        metrics=metrics,
        gate=gate,
    )


def _build_router(config: GatewayConfig, redis, registry: CollectorRegistry, pools: dict) -> Router:
    from cascade.classifier import load_reference_scores, load_scorer

    for name in (config.cascade_small_pool, config.cascade_large_pool):
        if name not in pools:
            raise ValueError(f"cascade pool {name!r} is not among the pools {sorted(pools)}")
    metrics = RoutingMetrics(registry)
    scorer, fell_back = load_scorer(config.classifier_path)
    if fell_back:
        metrics.fallback_scorer.inc()
    try:
        reference = load_reference_scores()
    except Exception:  # no reference sample: target fractions fall back to thresholds
        log.warning("no reference scores; routing target fractions are unavailable")
        reference = []
    log.info(
        "cascade: %s -> %s / %s, scorer %s",
        "auto",
        config.cascade_small_pool,
        config.cascade_large_pool,
        scorer.name,
    )
    small = pools[config.cascade_small_pool]

    def no_logprobs() -> str | None:
        """Why the small pool gives no logprobs, by its kind as configured or detected."""
        if small.kind in ("switchyard", "auto") or adapter_for(small.kind).gives_logprobs:
            return None
        return f"pool {small.name!r} is served by {small.kind}, which gives none"

    cache = Path(config.data_dir) / "classifiers" / "versions"
    cache.mkdir(parents=True, exist_ok=True)
    return Router(
        redis,
        scorer,
        reference,
        config.cascade_small_pool,
        config.cascade_large_pool,
        metrics,
        config.routing_poll_s,
        classifiers=ClassifierRegistry(redis, cache),
        no_logprobs=no_logprobs,
    )


def gateway_app(config: GatewayConfig) -> tuple[Litestar, Gateway, EmbeddedRedis | None]:
    embedded = None
    url = config.redis_url
    if url is None:
        embedded = EmbeddedRedis(Path(config.data_dir) / "redis")
        url = embedded.url
    gw = build_gateway(config, url)
    return create_gateway_app(gw), gw, embedded


def serve_gateway(
    config: GatewayConfig, host: str, port: int, member_command: list[str] | None = None
) -> int:
    """Serve until SIGINT/SIGTERM; the exit status. With `config.processes > 1`, supervise
    that many members started with `member_command` (each reads a `MemberSpec` on stdin
    and calls `serve_member`)."""
    sys.setswitchinterval(0.001)
    if config.processes > 1:
        if member_command is None:
            raise ValueError("several gateway processes need the command that starts one")
        return serve_processes(config, host, port, member_command)
    app, gw, embedded = gateway_app(config)
    log.info(
        "gateway on http://%s:%d, pools %s",
        host,
        port,
        {k: len(v) for k, v in config.pools.items()},
    )
    try:
        _serve(app, gw, config, host, port, None)
    finally:
        if embedded is not None:
            embedded.close()
    return 0


def serve_member(spec: MemberSpec) -> int:
    """One process of a gateway group: its own `Gateway` on its share of the capacity,
    listening on the group's port with SO_REUSEPORT; its parent holds the embedded Redis."""
    sys.setswitchinterval(0.001)
    config = spec.config
    assert config.redis_url is not None, "the parent gives its members the group's Redis"
    gw = build_gateway(config, config.redis_url)
    shared = ProcessMetrics(gw.registry, spec.index, Path(spec.procs_dir))
    app = create_gateway_app(gw, shared)
    sock = reuse_port_socket(spec.host, spec.port, listen=True)
    log.info(
        "gateway process %d/%d (pid %d) on http://%s:%d: %d in flight per worker, "
        "queue of %d requests / %d tokens per pool",
        spec.index,
        spec.num_processes,
        os.getpid(),
        spec.host,
        spec.port,
        config.max_inflight_per_worker,
        config.queue_max_requests,
        config.queue_max_tokens,
    )
    _serve(app, gw, config, spec.host, spec.port, [sock])
    return 0


def _serve(
    app: Litestar,
    gw: Gateway,
    config: GatewayConfig,
    host: str,
    port: int,
    sockets: list[socket.socket] | None,
) -> None:
    # uvicorn handles SIGINT/SIGTERM, shuts down, then re-raises the signal to the handler
    # that was there before it. Ours only notes it, so the caller's cleanup runs (the
    # embedded Redis is stopped, not orphaned) and Ctrl-C prints no traceback.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    server_cfg = server_config(
        app,
        host,
        port,
        header_timeout_s=config.header_timeout_s,
        keep_alive_timeout_s=config.keep_alive_timeout_s,
        shutdown_grace_s=config.shutdown_grace_s,
    )
    GatewayServer(server_cfg, config.shutdown_grace_s, gw.abort_flights).run(sockets)
    if received:
        log.info("gateway stopped (%s)", signal.Signals(received[0]).name)
