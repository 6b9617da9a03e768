"""`switchyard serve` settings: one YAML for the whole local stack.

Every field has a default here; `configs/serve.yaml` is the documented copy. Relative
paths in a config file resolve against that file's directory, not the current one.
"""

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from cli.config_files import fill, read_yaml
from gateway.config import GatewayConfig
from workers.engine.config import EngineConfig
from workers.fleet.autoscaler import AutoscalerConfig
from workers.fleet.devices import DeviceKind, Placement

DEMO_MODELS = ("demo-small", "demo-large")  # `switchyard models make-demo` checkpoints


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
        cfg.pools = {
            name: fill(PoolSection, body or {}, f"{where}: pools.{name}")
            for name, body in pools_raw.items()
        }
    check(cfg, where)
    return cfg


def check(cfg: ServeConfig, where: str) -> None:
    """Fail at start-up, naming the key, rather than in a worker process later."""
    for name, pool in cfg.pools.items():
        at = f"{where}: pools.{name}"
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
    reserved |= {"data_dir", "admin_key", "default_pool", "classifier_path"}
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
    c = cfg.cascade
    if c.enabled:
        for pool in (c.small_pool, c.large_pool):
            if pool not in cfg.pools:
                raise SystemExit(f"{where}: cascade pool {pool!r} is not among {sorted(cfg.pools)}")
        if c.target_fraction is not None and not 0.0 <= c.target_fraction <= 1.0:
            raise SystemExit(f"{where}: cascade.target_fraction must be in [0, 1]")


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
