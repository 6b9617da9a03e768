"""`switchyard serve` settings: one YAML for the whole local stack.

Every field has a default here; `configs/serve.yaml` is the documented copy. Relative
paths in a config file resolve against that file's directory, not the current one.
"""

import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from cli.config_files import fill, read_yaml
from gateway.config import GatewayConfig, UpstreamConfig
from workers.engine.config import EngineConfig
from workers.fleet.autoscaler import AutoscalerConfig
from workers.fleet.devices import DeviceKind, Placement
from workers.fleet.hosts import check_host_id
from workers.fleet.lease import LeaseConfig

DEMO_MODELS = ("demo-small", "demo-large")  # `switchyard models make-demo` checkpoints
# What a pool's replicas are: Switchyard workers, or llama.cpp's llama-server processes.
# (Other upstream kinds are servers serve does not start: `switchyard gateway` fronts them.)
POOL_KINDS = ("switchyard", "llamacpp")


@dataclass
class LlamaServerSection:
    """The llama-server a `kind: llamacpp` pool runs when it gives no `command`: the cached
    build (built at first start when missing) on the pool's `model`'s own GGUF."""

    gguf: str | None = None  # a local GGUF file instead; null: `model`'s, from its wheel
    slots: int = 4  # -np: sequences one replica runs at once (the gateway reads /props)
    ctx_per_slot: int = 2048  # the context (-c) is slots x this, in tokens
    threads: int | None = None  # null: the replica's own cores (else the CPUs shared out)
    extra_args: list[str] = field(default_factory=list)  # appended to the command line


@dataclass
class PoolSection:
    """One pool: which model its workers serve, how many, with which engine settings."""

    # A known model (`switchyard models list`), fetched when missing, or `demo-small` /
    # `demo-large` (tiny random checkpoints, made when missing).
    model: str = "smollm2-135m-instruct"
    model_dir: str | None = None  # a local checkpoint directory instead of `model`
    min_replicas: int = 1
    max_replicas: int = 2
    # Each replica is a shard group of this many ranks (one process per device), started,
    # drained and restarted as one unit; the autoscaler counts the group as one replica.
    tensor_parallel: int = 1
    # CPU pools: the cores each rank runs on, its own (pinned; its threads follow). None:
    # the host's cores split evenly over every pool's ranks at max_replicas (at least one
    # each). A GPU pool's rank gets one GPU of its own.
    cores_per_rank: int | None = None
    # Latency targets. The gateway refuses at arrival (503 over_capacity, Retry-After) a
    # request it predicts would get its first token later than ttft_target_s, from what
    # the replicas measure; the workers bound their running batch so a step, hence every
    # stream's inter-token gap, stays within itl_target_s (engine.scheduler.itl_target_s).
    # null: no target (admission by counts and deadlines only; the batch by max_num_seqs).
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    worker: dict[str, Any] = field(default_factory=dict)  # WorkerConfig fields
    autoscaler: dict[str, Any] = field(default_factory=dict)  # AutoscalerConfig fields
    # `switchyard`: the pool's replicas are Switchyard workers (everything above applies).
    # `llamacpp`: llama.cpp's llama-server processes, supervised like workers (restarted
    # with backoff; drained by leaving the gateway's rotation, then SIGTERM once /slots
    # shows nothing processing) and fixed-size: the autoscaler does not resize them, so
    # give `replicas`, not a min..max range. engine, worker, autoscaler, model_dir,
    # tensor_parallel and itl_target_s are for workers only.
    kind: str = "switchyard"
    replicas: int | None = None  # min_replicas = max_replicas = this (a llamacpp pool: 1)
    # llamacpp: the llama-server command line (a list, or one string split as a shell
    # would), without --host/--port: serve adds them per replica. null: `llama_server`.
    command: list[str] | str | None = None
    llama_server: LlamaServerSection = field(default_factory=LlamaServerSection)
    # llamacpp: the gateway's UpstreamConfig fields but kind (max_concurrency, ...).
    upstream: dict[str, Any] = field(default_factory=dict)
    # What the pool charges (gateway/billing/prices.py PoolPrice): per million prompt,
    # cached and completion tokens, or per compute-second; null: free. Changed at runtime
    # with PUT /admin/prices.
    price: dict[str, Any] | None = None

    @property
    def argv(self) -> list[str] | None:
        """`command` as a list (None: the default llama-server)."""
        if self.command is None:
            return None
        return shlex.split(self.command) if isinstance(self.command, str) else list(self.command)


@dataclass
class GatewaySection:
    host: str = "127.0.0.1"
    port: int = 8000
    # Any other GatewayConfig field (queue sizes, timeouts, ...); pools, tokenizers, the
    # cascade pools, redis_url and data_dir are set by serve from the sections here.
    options: dict[str, Any] = field(default_factory=lambda: {"shutdown_grace_s": 10.0})
    admin_key: str | None = None  # None: $SWITCHYARD_ADMIN_KEY, else generated (0600 file)


@dataclass
class CascadeSection:
    """`model: auto` chooses between these pools."""

    enabled: bool = True
    small_pool: str = "small"
    large_pool: str = "large"
    # Share of reference traffic `auto` sends to the large pool, set at first start as
    # the routing default (`switchyard admin`/`PUT /admin/routing` change it later).
    target_fraction: float | None = 0.3
    classifier_path: str | None = None  # None: the artifact shipped in cascade/artifacts


@dataclass
class FleetSection:
    autoscale: bool = True  # False: each pool stays at min_replicas
    interval_s: float = 1.0  # one autoscaler tick per pool
    rate_window_s: float = 10.0  # arrivals and service time are measured over this
    restart_base_s: float = 1.0  # restart backoff of a crashed worker: 1, 2, 4 ... s
    restart_max_s: float = 30.0
    stall_restart_s: float = 30.0  # a worker stalled this long is killed and restarted
    # Back from a stall, a worker counts as stalled until it has been ready this long (a
    # flapping one is restarted stall_restart_s after its first stall).
    stall_recover_s: float = 5.0
    start_timeout_s: float = 300.0  # a worker not ready by then is killed and restarted
    stop_grace_s: float = 10.0  # at shutdown: SIGTERM, then SIGKILL after this
    # Each replica on devices of its own (CPU cores or GPUs, workers/fleet/devices.py), and
    # none started that the free devices cannot hold. False: replicas share the machine.
    place_on_devices: bool = True
    # One of several hosts sharing `redis_url` (`switchyard serve --join REDIS_URL`): this
    # host's supervisor and gateway join the fleet whose quotas, membership and leader
    # lease live there. The supervisors elect one leader (a lease of lease_ttl_s with a
    # fencing token) that autoscales every pool across all hosts (min/max_replicas are
    # fleet-wide) and places new replicas on hosts with free devices; each host starts and
    # drains what it is ordered. False: a single host, its own leader.
    join: bool = False
    host_id: str | None = None  # this host in the fleet; None: the hostname
    lease_ttl_s: float = 6.0  # a dead leader is replaced within this
    # The address this host's Switchyard workers listen on and are announced at: loopback
    # serves this host's gateway alone (or a fleet on one machine); on a fleet of machines,
    # this host's own address, so the other hosts' gateways reach them.
    worker_host: str = "127.0.0.1"


@dataclass
class DemoSection:
    tenant: str = "demo"  # created, with one key, at first start
    tokens_per_minute: int | None = 200_000


@dataclass
class ServeConfig:
    data_dir: str = "data"  # Redis data, admin key, worker logs, demo state
    redis_url: str | None = None  # None: an embedded Redis persisted under data_dir
    models_dir: str | None = None  # fetched models (None: the cache, ~/.cache/switchyard)
    pools: dict[str, PoolSection] = field(
        default_factory=lambda: {"small": PoolSection(), "large": PoolSection(max_replicas=1)}
    )
    gateway: GatewaySection = field(default_factory=GatewaySection)
    cascade: CascadeSection = field(default_factory=CascadeSection)
    fleet: FleetSection = field(default_factory=FleetSection)
    demo: DemoSection = field(default_factory=DemoSection)
    base_dir: Path = field(default_factory=Path.cwd)  # what relative paths resolve against

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.base_dir / p).resolve()


def load_serve_config(path: str | Path | None) -> ServeConfig:
    """The config at `path` (None: defaults, paths against the current directory)."""
    if path is None:
        return ServeConfig()
    path = Path(path).resolve()
    if not path.is_file():
        raise SystemExit(f"error: no config file at {path} (give --config, or omit it)")
    raw = dict(read_yaml(path))
    where = str(path)
    pools_raw = raw.pop("pools", None)
    cfg: ServeConfig = fill(ServeConfig, raw, where)
    cfg.base_dir = path.parent
    if pools_raw is not None:
        if not isinstance(pools_raw, dict) or not pools_raw:
            raise SystemExit(f"{where}: pools must map pool names to settings")
        cfg.pools = {}
        for name, body in pools_raw.items():
            at = f"{where}: pools.{name}"
            cfg.pools[name] = fill(PoolSection, body or {}, at)
            fix_size(cfg.pools[name], set(body or {}), at)
    check(cfg, where)
    return cfg


def fix_size(pool: PoolSection, keys: set[str], at: str) -> None:
    """`replicas` into min_replicas = max_replicas; a llamacpp pool is fixed-size."""
    ranged = sorted(keys & {"min_replicas", "max_replicas"})
    if pool.replicas is not None:
        if not isinstance(pool.replicas, int) or pool.replicas < 1:
            raise SystemExit(f"{at}.replicas must be a whole number >= 1")
        if ranged:
            raise SystemExit(f"{at}: give replicas or {' and '.join(ranged)}, not both")
        pool.min_replicas = pool.max_replicas = pool.replicas
    elif pool.kind == "llamacpp":
        if ranged and pool.min_replicas != pool.max_replicas:
            raise SystemExit(
                f"{at}: a llamacpp pool is fixed-size (the autoscaler does not resize "
                f"llama-server pools): set replicas: N, not min_replicas..max_replicas "
                f"({pool.min_replicas}..{pool.max_replicas})"
            )
        if not ranged:
            pool.min_replicas = pool.max_replicas = 1


def check(cfg: ServeConfig, where: str) -> None:
    """Fail at start-up, naming the key, rather than in a worker process later."""
    for name, pool in cfg.pools.items():
        at = f"{where}: pools.{name}"
        if pool.kind not in POOL_KINDS:
            raise SystemExit(
                f"{at}.kind must be one of {list(POOL_KINDS)}, not {pool.kind!r} (servers of "
                "other kinds are not started by serve: run `switchyard gateway` in front of them)"
            )
        if pool.kind == "llamacpp":
            check_llamacpp(pool, at)
            continue
        if pool.command is not None or pool.upstream:
            raise SystemExit(f"{at}: command and upstream are for kind: llamacpp pools")
        if not isinstance(pool.tensor_parallel, int) or pool.tensor_parallel < 1:
            raise SystemExit(f"{at}.tensor_parallel must be a whole number >= 1")
        if pool.cores_per_rank is not None and (
            not isinstance(pool.cores_per_rank, int) or pool.cores_per_rank < 1
        ):
            raise SystemExit(f"{at}.cores_per_rank must be a whole number >= 1, or null")
        fill(EngineConfig, pool.engine, f"{at}.engine")
        for key in ("ttft_target_s", "itl_target_s"):
            value = getattr(pool, key)
            if value is not None and (not isinstance(value, int | float) or value <= 0):
                raise SystemExit(f"{at}.{key} must be a number of seconds > 0, or null")
        from workers.server.config import WorkerConfig

        fill(WorkerConfig, pool.worker, f"{at}.worker")
        scaler_keys = {f.name for f in fields(AutoscalerConfig)} - {"min_replicas", "max_replicas"}
        unknown = sorted(set(pool.autoscaler) - scaler_keys)
        if unknown:
            raise SystemExit(f"{at}.autoscaler: unknown keys {unknown}")
        try:
            autoscaler_config(pool)
        except ValueError as exc:
            raise SystemExit(f"{at}: {exc}") from None
    reserved = {"pools", "tokenizers", "cascade_small_pool", "cascade_large_pool", "redis_url"}
    reserved |= {"data_dir", "admin_key", "default_pool", "classifier_path", "upstreams"}
    reserved |= {"prices"}  # pools.<name>.price
    from gateway.billing.prices import prices_from_dict

    try:
        prices_from_dict(
            {n: p.price for n, p in cfg.pools.items() if p.price is not None},
            {n: p.kind for n, p in cfg.pools.items()},
        )
    except ValueError as exc:
        raise SystemExit(f"{where}: {exc}") from None
    bad = sorted(set(cfg.gateway.options) & reserved)
    if bad:
        raise SystemExit(f"{where}: gateway.options may not set {bad} (serve sets them)")
    gateway = fill(GatewayConfig, cfg.gateway.options, f"{where}: gateway.options")
    if gateway.processes != 1:
        # The fleet supervisor adds and removes workers by method calls on this process's
        # pools; other gateway processes would not see them (membership is not in Redis).
        raise SystemExit(
            f"{where}: gateway.options.processes must be 1: `switchyard serve` runs one "
            "gateway process beside its fleet supervisor. For several, run `switchyard "
            "gateway --workers N` in front of separately started `switchyard worker`s"
        )
    check_fleet(cfg, where)
    c = cfg.cascade
    if c.enabled:
        for pool in (c.small_pool, c.large_pool):
            if pool not in cfg.pools:
                raise SystemExit(f"{where}: cascade pool {pool!r} is not among {sorted(cfg.pools)}")
        if c.target_fraction is not None and not 0.0 <= c.target_fraction <= 1.0:
            raise SystemExit(f"{where}: cascade.target_fraction must be in [0, 1]")


def check_fleet(cfg: ServeConfig, where: str) -> None:
    fleet = cfg.fleet
    if fleet.join and not cfg.redis_url:
        raise SystemExit(
            f"{where}: fleet.join needs redis_url: the Redis every host of the fleet shares "
            "(or give it with --join REDIS_URL)"
        )
    if fleet.host_id is not None:
        try:
            check_host_id(fleet.host_id)
        except ValueError as exc:
            raise SystemExit(f"{where}: fleet.host_id: {exc}") from None
    if not isinstance(fleet.lease_ttl_s, int | float) or fleet.lease_ttl_s < 1.0:
        raise SystemExit(f"{where}: fleet.lease_ttl_s must be a number of seconds >= 1")
    if not isinstance(fleet.worker_host, str) or fleet.worker_host in ("", "0.0.0.0", "::"):
        raise SystemExit(
            f"{where}: fleet.worker_host must be an address the gateways reach the workers "
            f"at (this host's own, or 127.0.0.1), not {fleet.worker_host!r}"
        )


def lease_config(cfg: ServeConfig) -> LeaseConfig:
    """The leader lease: renewed every ttl / 3; a holder stops leading a tenth of the ttl
    (at most half a second) before its key can expire."""
    ttl_s = float(cfg.fleet.lease_ttl_s)
    return LeaseConfig(ttl_s=ttl_s, margin_s=min(0.5, ttl_s / 10))


def check_llamacpp(pool: PoolSection, at: str) -> None:
    worker_only = {
        "engine": bool(pool.engine),
        "worker": bool(pool.worker),
        "autoscaler": bool(pool.autoscaler),
        "model_dir": pool.model_dir is not None,
        "tensor_parallel": pool.tensor_parallel != 1,
        "itl_target_s": pool.itl_target_s is not None,
    }
    bad = [key for key, given in worker_only.items() if given]
    if bad:
        raise SystemExit(f"{at}: {bad} are for Switchyard workers, not a llamacpp pool")
    if pool.min_replicas != pool.max_replicas or pool.min_replicas < 1:
        raise SystemExit(f"{at}: a llamacpp pool is fixed-size: set replicas: N (N >= 1)")
    argv = pool.argv
    if argv is not None:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SystemExit(f"{at}.command must be a command line (a string or strings)")
        taken = sorted({"--host", "--port"} & {a.split("=", 1)[0] for a in argv})
        if taken:
            raise SystemExit(f"{at}.command may not set {taken}: serve gives each replica its port")
        if pool.llama_server != LlamaServerSection():
            raise SystemExit(f"{at}: llama_server settings apply only without a command")
    ls = pool.llama_server
    for key in ("slots", "ctx_per_slot"):
        value = getattr(ls, key)
        if not isinstance(value, int) or value < 1:
            raise SystemExit(f"{at}.llama_server.{key} must be a whole number >= 1")
    if ls.threads is not None and (not isinstance(ls.threads, int) or ls.threads < 1):
        raise SystemExit(f"{at}.llama_server.threads must be a whole number >= 1, or null")
    if argv is None and ls.gguf is None and pool.model in DEMO_MODELS:
        raise SystemExit(f"{at}.model: {pool.model} has no GGUF; name a known model or a gguf")
    if "kind" in pool.upstream:
        raise SystemExit(f"{at}.upstream may not set kind (it is the pool's kind)")
    fill(UpstreamConfig, pool.upstream, f"{at}.upstream")


def upstream_config(pool: PoolSection) -> UpstreamConfig | None:
    """The gateway's upstream settings of a llamacpp pool (None: Switchyard workers)."""
    if pool.kind != "llamacpp":
        return None
    return fill(UpstreamConfig, {**pool.upstream, "kind": "llamacpp"}, "upstream")


def device_kind(pool: PoolSection) -> DeviceKind:
    """What a pool's replicas run on, from its engine's device setting."""
    return "cuda" if str(pool.engine.get("device", "cpu")).startswith("cuda") else "cpu"


def placements(cfg: ServeConfig, devices: dict[DeviceKind, list[int]]) -> dict[str, Placement]:
    """Each pool's placement on the host's `devices`, or SystemExit when the pools' warm
    replicas (min_replicas) do not fit them: serve never starts more than the host holds."""
    kinds = {name: device_kind(pool) for name, pool in cfg.pools.items()}
    most_ranks = {kind: 0 for kind in devices}  # every pool at its max_replicas
    for name, pool in cfg.pools.items():
        most_ranks[kinds[name]] = most_ranks.get(kinds[name], 0) + (
            pool.max_replicas * pool.tensor_parallel
        )
    out: dict[str, Placement] = {}
    for name, pool in cfg.pools.items():
        kind = kinds[name]
        if kind == "cuda":
            per_rank = 1
        elif pool.cores_per_rank is not None:
            per_rank = pool.cores_per_rank
        else:
            per_rank = max(len(devices.get(kind, ())) // max(most_ranks[kind], 1), 1)
        out[name] = Placement(kind, per_rank, pool.tensor_parallel)
    for kind, have in devices.items():
        need = [
            (name, cfg.pools[name].min_replicas, p)
            for name, p in out.items()
            if p.kind == kind and cfg.pools[name].min_replicas
        ]
        total = sum(n * p.count for _, n, p in need)
        if total > len(have):
            parts = ", ".join(f"{name} {n} x {p.count}" for name, n, p in need)
            raise SystemExit(
                f"the pools' min_replicas need {total} {kind} devices ({parts}); this host "
                f"has {len(have)}. Lower min_replicas or cores_per_rank, or set "
                "fleet.place_on_devices: false to let replicas share them"
            )
    return out


def autoscaler_config(pool: PoolSection) -> AutoscalerConfig:
    return AutoscalerConfig(
        min_replicas=pool.min_replicas, max_replicas=pool.max_replicas, **pool.autoscaler
    )


def defaults_yaml() -> str:
    """The built-in defaults as YAML (for `switchyard serve --help`)."""
    import yaml

    doc = asdict(ServeConfig())
    doc.pop("base_dir")
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
