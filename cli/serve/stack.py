"""`switchyard serve`: models, Redis, the gateway and the fleet supervisor in one process.

One asyncio loop runs the gateway (uvicorn), the supervisor's loop and the start-up status.
Signals are ours, not uvicorn's: SIGINT or SIGTERM stops the gateway (in-flight requests
get `shutdown_grace_s` to finish), then the workers, then the embedded Redis, and the
process exits 0. A second signal kills the workers outright.
"""

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
import yaml

from cli.commands.models import cache_dir
from cli.config_files import fill
from cli.logs import setup_logging
from cli.serve import console, state
from cli.serve.announce import announced_membership
from cli.serve.config import (
    DEMO_MODELS,
    ServeConfig,
    device_kind,
    placements,
    upstream_config,
)
from cli.serve.fleet import FleetLoop, PoolMembership
from cli.serve.joined import JoinedFleetLoop, make_fleet_loop
from cli.serve.llamacpp import llama_server_files, llamacpp_argv, llamacpp_launch
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from gateway.runtime.embedded_redis import EmbeddedRedis
from gateway.runtime.http_server import server_config
from gateway.runtime.main import build_gateway
from quota.models import TenantLimits
from workers.api.client import WorkerClient
from workers.fleet.devices import DeviceInventory, Placement
from workers.fleet.supervisor import (
    LocalSupervisor,
    Membership,
    PoolLaunch,
    SupervisorConfig,
    detect_devices,
)

log = logging.getLogger(__name__)


class StartupError(Exception):
    """A one-line reason the stack cannot start (a taken port, a missing model)."""


@dataclass
class RunOptions:
    config_path: Path | None
    log_level: str = "info"
    log_format: str = "text"


# -- before the loop: ports, models, keys ------------------------------------------------


def check_port_free(host: str, port: int, option: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise StartupError(
                f"port {port} on {host} is in use; choose another with {option}"
            ) from None


def ensure_models(cfg: ServeConfig, data_dir: Path) -> dict[str, Path]:
    """Each worker pool's checkpoint directory; fetches or makes what is missing (progress
    bars). llamacpp pools have none (`ensure_llama_servers`)."""
    from workers.errors import ModelFetchError

    dirs: dict[str, Path] = {}
    for name, pool in cfg.pools.items():
        if pool.kind == "llamacpp":
            continue
        if pool.model_dir:
            path = cfg.path(pool.model_dir)
            if not (path / "config.json").is_file():
                raise StartupError(
                    f"pools.{name}.model_dir: {path} is not a checkpoint (no config.json)"
                )
        elif pool.model in DEMO_MODELS:
            path = data_dir / "models" / pool.model.removeprefix("demo-")
            if not (path / "config.json").is_file():
                from workers.models.demo import make_demo_checkpoints

                console.note(f"making the demo checkpoints under {path.parent}")
                make_demo_checkpoints(path.parent, show_progress=True)
        else:
            from workers.models.fetch import fetch_model
            from workers.models.registry import find_model

            try:
                spec = find_model(pool.model)
                models = cfg.path(cfg.models_dir) if cfg.models_dir else None
                fetched = fetch_model(spec, cache_dir(None), models_dir=models, show_progress=True)
            except ModelFetchError as exc:
                raise StartupError(f"pools.{name}.model: {exc}") from None
            path = fetched.path
        if pool.tensor_parallel != 1:
            from workers.models.model_config import load_model_config
            from workers.tp.plan import ShardingError, check_shardable

            try:
                check_shardable(load_model_config(path), pool.tensor_parallel)
            except ShardingError as exc:
                raise StartupError(f"pools.{name}.tensor_parallel: {exc}") from None
        dirs[name] = path
    return dirs


def ensure_llama_servers(cfg: ServeConfig) -> dict[str, tuple[Path, Path] | None]:
    """Per llamacpp pool, the (binary, GGUF) its default command runs, built or extracted
    now when missing (None: the pool gives its own command)."""
    from benchmarks.peers.llama_server import BUILD_COMMAND, LlamaServerError
    from workers.errors import ModelFetchError

    files: dict[str, tuple[Path, Path] | None] = {}
    for name, pool in cfg.pools.items():
        if pool.kind != "llamacpp":
            continue
        if pool.argv is not None:
            files[name] = None
            continue
        try:
            files[name] = llama_server_files(cfg, pool, cache_dir(None) / "wheels", console.note)
        except LlamaServerError as exc:
            raise StartupError(
                f"pools.{name}: llama-server could not be built ({exc}); build it with "
                f"`{BUILD_COMMAND}` (scripts/setup.sh runs it), or give the pool a command"
            ) from None
        except (ModelFetchError, FileNotFoundError) as exc:
            raise StartupError(f"pools.{name}: {exc}") from None
    return files


def llama_server_launches(
    cfg: ServeConfig,
    files: dict[str, tuple[Path, Path] | None],
    client: WorkerClient,
    placed: dict[str, Placement] | None = None,
) -> dict[str, PoolLaunch]:
    """How each llamacpp pool's replicas start, and how the supervisor watches them."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    warm = max(sum(p.min_replicas * p.tensor_parallel for p in cfg.pools.values()), 1)
    launches = {}
    for name, pool in cfg.pools.items():
        if pool.kind != "llamacpp":
            continue
        placement = placed.get(name) if placed is not None else None
        threads = placement.count if placement is not None else max((cpus or 1) // warm, 1)
        argv = llamacpp_argv(name, pool, files.get(name), threads)
        launches[name] = llamacpp_launch(argv, client, placement)
    return launches


def worker_launches(
    cfg: ServeConfig,
    model_dirs: dict[str, Path],
    run_dir: Path,
    opts: RunOptions,
    placed: dict[str, Placement] | None = None,
) -> dict[str, PoolLaunch]:
    """How each pool's workers start: `python -m cli worker` with a per-pool YAML.
    `placed`: each pool's devices per replica (None: replicas share the machine)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Processes, not replicas: a replica of a sharded pool is `tensor_parallel` ranks.
    warm = max(sum(p.min_replicas * p.tensor_parallel for p in cfg.pools.values()), 1)
    launches = {}
    for name, pool in cfg.pools.items():
        if pool.kind != "switchyard":
            continue
        engine = dict(pool.engine)
        if pool.itl_target_s is not None:
            engine["scheduler"] = {**engine.get("scheduler", {}), "itl_target_s": pool.itl_target_s}
        placement = placed.get(name) if placed is not None else None
        if placement is None:
            # Workers share the machine: split the CPUs over the warm replicas.
            engine.setdefault("threads", max((cpus or 1) // warm, 1))
        elif engine.get("threads") is None:
            engine.pop("threads", None)  # a placed rank's threads follow its own cores
        worker_yaml = run_dir / f"worker-{name}.yaml"
        worker_yaml.write_text(yaml.safe_dump({"engine": engine, "worker": pool.worker}))
        control_key = os.urandom(16).hex()
        argv_head = [sys.executable, "-m", "cli", "--log-level", opts.log_level]
        argv_head += ["--log-format", opts.log_format, "worker"]

        shard = ["--tensor-parallel", str(pool.tensor_parallel)] if pool.tensor_parallel > 1 else []

        def argv(
            port: int, _name=name, _yaml=worker_yaml, _head=argv_head, _shard=shard
        ) -> list[str]:
            return [
                *_head,
                "--model",
                str(model_dirs[_name]),
                "--host",
                cfg.fleet.worker_host,
                "--port",
                str(port),
                "--config",
                str(_yaml),
                "--served-model-name",
                _name,
                *_shard,
            ]

        launches[name] = PoolLaunch(
            argv,
            env={"SWITCHYARD_WORKER_CONTROL_KEY": control_key},
            control_key=control_key,
            placement=placement,
            host=cfg.fleet.worker_host,
        )
    return launches


def gateway_config(
    cfg: ServeConfig, model_dirs: dict[str, Path], data_dir: Path, admin_key: str
) -> GatewayConfig:
    gc: GatewayConfig = fill(GatewayConfig, dict(cfg.gateway.options), "gateway.options")
    gc.pools = {name: [] for name in cfg.pools}
    targets = {n: p.ttft_target_s for n, p in cfg.pools.items() if p.ttft_target_s is not None}
    gc.ttft_target_s = {**targets, **gc.ttft_target_s}  # gateway.options' own win
    gc.tokenizers = {name: str(path) for name, path in model_dirs.items()}
    gc.prices = {name: dict(p.price) for name, p in cfg.pools.items() if p.price is not None}
    for name, pool in cfg.pools.items():
        upstream = upstream_config(pool)
        if upstream is None:
            continue
        gc.upstreams[name] = upstream
        # The same model on Switchyard workers elsewhere: its tokenizer counts for this one.
        same = [n for n, p in cfg.pools.items() if n in model_dirs and p.model == pool.model]
        if pool.argv is None and pool.llama_server.gguf is None and same:
            gc.tokenizers[name] = str(model_dirs[same[0]])
    gc.redis_url = cfg.redis_url
    gc.data_dir = str(data_dir)
    gc.admin_key = admin_key
    c = cfg.cascade
    if c.enabled:
        gc.cascade_small_pool, gc.cascade_large_pool = c.small_pool, c.large_pool
        gc.default_pool = c.small_pool
        gc.classifier_path = str(cfg.path(c.classifier_path)) if c.classifier_path else None
    else:
        gc.default_pool = next(iter(cfg.pools))
    return gc


# -- the loop -----------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its signal handling (the stack owns SIGINT/SIGTERM and does not
    want them raised again after shutdown), cutting what is left after the grace."""

    def __init__(self, config: uvicorn.Config, gw: Gateway, grace_s: float) -> None:
        super().__init__(config)
        self.gw = gw
        self.grace_s = grace_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets=None) -> None:  # noqa: ANN001
        abort = getattr(self.gw, "abort_flights", None)
        timer = None
        if abort is not None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, abort)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


class Stack:
    def __init__(self, cfg: ServeConfig, opts: RunOptions) -> None:
        self.cfg = cfg
        self.opts = opts
        self.data_dir = cfg.path(cfg.data_dir)
        self.stop = asyncio.Event()
        self.signals = 0
        self.supervisor: LocalSupervisor | None = None
        self.server: uvicorn.Server | None = None

    def on_signal(self, signum: int) -> None:
        self.signals += 1
        if self.signals == 1:
            console.note(f"{signal.Signals(signum).name}: stopping (again to stop at once)")
            self.stop.set()
        elif self.supervisor is not None:
            self.supervisor.kill_all_now()
            if self.server is not None:
                self.server.force_exit = True

    async def run(
        self,
        model_dirs: dict[str, Path],
        redis_url: str,
        admin_key: str,
        llama_files: dict[str, tuple[Path, Path] | None] | None = None,
    ) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)
        gcfg = gateway_config(cfg, model_dirs, self.data_dir, admin_key)
        gw = build_gateway(gcfg, redis_url)
        probe = WorkerClient(connect_timeout_s=1.0)
        inventory, placed = None, None
        if cfg.fleet.place_on_devices:
            devices = detect_devices({device_kind(p) for p in cfg.pools.values()})
            try:
                placed = placements(cfg, devices)
            except SystemExit as exc:
                raise StartupError(str(exc)) from None
            inventory = DeviceInventory(devices)
            for name, p in placed.items():
                log.info(
                    "pool %s: each replica on %d %s device(s) of its own", name, p.count, p.kind
                )
        launches = worker_launches(cfg, model_dirs, self.data_dir / "run", self.opts, placed)
        launches |= llama_server_launches(cfg, llama_files or {}, probe, placed)
        membership: Membership = PoolMembership(
            gw.pools, self.data_dir / "prometheus" / "workers.json"
        )
        announced = None
        if gcfg.membership.enabled:
            # The local replicas in the fleet's Redis too, for the other hosts' gateways.
            announced = announced_membership(
                gcfg, redis_url, cfg, model_dirs, membership, host_id=cfg.fleet.host_id
            )
            membership = announced
            if gw.membership is not None:
                gw.membership.skip_announcer = announced.announcer.announcer_id
        gw.demand = None  # this host's record (serve --join) carries its demand
        supervisor = LocalSupervisor(
            {name: launches[name] for name in cfg.pools},
            probe,
            membership,
            SupervisorConfig(
                log_dir=self.data_dir / "logs",
                restart_base_s=cfg.fleet.restart_base_s,
                restart_max_s=cfg.fleet.restart_max_s,
                stall_restart_s=cfg.fleet.stall_restart_s,
                stall_recover_s=cfg.fleet.stall_recover_s,
                start_timeout_s=cfg.fleet.start_timeout_s,
                stop_grace_s=cfg.fleet.stop_grace_s,
            ),
            inventory=inventory,
        )
        self.supervisor = supervisor
        if announced is not None:
            announced.supervisor = supervisor
            announced.announcer.start()
        fleet = make_fleet_loop(cfg, gw, supervisor, redis_url)  # one host, or a fleet's
        host, port = cfg.gateway.host, cfg.gateway.port
        server_cfg = server_config(
            create_gateway_app(gw),
            host,
            port,
            header_timeout_s=gcfg.header_timeout_s,
            keep_alive_timeout_s=gcfg.keep_alive_timeout_s,
            shutdown_grace_s=gcfg.shutdown_grace_s,
        )
        server_cfg.access_log = False  # the gateway logs one line per request itself
        console.route_uvicorn_logs()
        self.server = _Server(server_cfg, gw, gcfg.shutdown_grace_s)
        url = f"http://{host}:{port}"
        serving = asyncio.ensure_future(self.server.serve())
        fleet_task: asyncio.Task | None = None
        try:
            while not self.server.started:
                if serving.done():
                    serving.result()
                    raise StartupError(f"the gateway did not start on {host}:{port}")
                await asyncio.sleep(0.02)
            # Litestar set up its own logging at start-up: ours again (format, level).
            setup_logging(self.opts.log_level, self.opts.log_format)
            console.route_uvicorn_logs()
            for name, pool in cfg.pools.items():
                for _ in range(0 if cfg.fleet.join else pool.min_replicas):  # else: the leader's
                    supervisor.start_replica(name)
            fleet_task = asyncio.ensure_future(fleet.run())
            if not await self._wait_ready(gw, supervisor, url, fleet):
                return 0
            await self._first_start(gw, url, admin_key)
            await self.stop.wait()
            return 0
        finally:
            self.stop.set()
            console.note("stopping the gateway")
            self.server.should_exit = True
            with contextlib.suppress(BaseException):
                await serving
            if fleet_task is not None:
                fleet_task.cancel()
                with contextlib.suppress(BaseException):
                    await fleet_task
            if isinstance(fleet, JoinedFleetLoop):  # the lease to another host, at once
                await fleet.leave()
            if announced is not None:  # out of every gateway's rotation first
                await announced.announcer.close()
                await announced.announcer.store.redis.aclose()
            console.note("stopping the workers")
            await supervisor.stop()
            await probe.aclose()

    async def _wait_ready(
        self,
        gw: Gateway,
        supervisor: LocalSupervisor,
        url: str,
        fleet: FleetLoop | JoinedFleetLoop | None = None,
    ) -> bool:
        """Until every pool has its warm replicas ready (on a fleet: on any host) and the
        gateway routes to them, with a live status line. False: stopped first."""
        t0 = time.monotonic()
        with console.Status() as status:
            while not self.stop.is_set():
                lines, ready = [], True
                for name, pool in self.cfg.pools.items():
                    reps = supervisor.pool_replicas(name)
                    num_ready = sum(r.state == "ready" for r in reps)
                    if isinstance(fleet, JoinedFleetLoop):
                        num_ready = fleet.fleet_ready(name)
                    routed = any(v.state == "ready" for v in gw.pools[name].views.values())
                    ready &= num_ready >= pool.min_replicas and routed
                    restarts = sum(r.num_restarts for r in reps)
                    extra = (
                        f", {restarts} restarts (see {self.data_dir / 'logs'})" if restarts else ""
                    )
                    lines.append(f"{name} {num_ready}/{pool.min_replicas} ready{extra}")
                elapsed = time.monotonic() - t0
                status.update(f"gateway {url} up · " + " · ".join(lines) + f" · {elapsed:.0f} s")
                if ready:
                    return True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 0.25)
        return False

    async def _first_start(self, gw: Gateway, url: str, admin_key: str) -> None:
        cfg = self.cfg
        if gw.router is not None and cfg.cascade.target_fraction is not None:
            current = await gw.router.refresh(force=True)
            if current.version == 0:
                await gw.router.update(
                    {"default_target_fraction": cfg.cascade.target_fraction},
                    set(),
                    "switchyard serve (first start)",
                )
        tenant = cfg.demo.tenant
        saved = state.read_state(self.data_dir)
        key = None
        if await gw.store.get_tenant(tenant) is None:
            limits = TenantLimits(tokens_per_minute=cfg.demo.tokens_per_minute)
            await gw.store.create_tenant(tenant, tenant, limits, [], True)
            issued = await gw.store.create_key(tenant, "demo")
            key = issued.plaintext
            saved = {"tenant": tenant, "key_id": issued.record.key_id, "shown_at": time.time()}
            state.write_state(self.data_dir, saved)
        console.banner(url, key, saved, tenant, self.cfg, self.data_dir)


def run_serve(cfg: ServeConfig, opts: RunOptions) -> int:
    """The whole stack, in the foreground, until SIGINT/SIGTERM. The exit status."""
    data_dir = cfg.path(cfg.data_dir)
    where = f"--port or gateway.port in {opts.config_path}" if opts.config_path else "--port"
    check_port_free(cfg.gateway.host, cfg.gateway.port, where)
    data_dir.mkdir(parents=True, exist_ok=True)
    model_dirs = ensure_models(cfg, data_dir)
    llama_files = ensure_llama_servers(cfg)
    key = cfg.gateway.admin_key or os.environ.get("SWITCHYARD_ADMIN_KEY")
    key_file = None
    if not key:
        key, key_file, created = state.admin_key(data_dir)
        if created:
            console.note(f"generated an admin key in {key_file} (mode 0600)")
    url = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    state.write_pointer(cache_dir(None), url, data_dir, key_file)
    embedded = None
    try:
        redis_url = cfg.redis_url
        if redis_url is None:
            embedded = EmbeddedRedis(data_dir / "redis")
            redis_url = embedded.url
        stack = Stack(cfg, opts)
        return asyncio.run(stack.run(model_dirs, redis_url, key, llama_files))
    finally:
        if embedded is not None:
            console.note("stopping Redis")
            embedded.close()
