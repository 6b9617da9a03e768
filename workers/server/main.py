"""A worker process: load the engine in the background, serve HTTP with uvicorn."""

import logging
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from workers.engine.async_engine import AsyncEngine
from workers.engine.calibration import calibrate
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.server.app import create_worker_app
from workers.server.config import WorkerConfig
from workers.server.join import FleetJoin, JoinConfig
from workers.server.metrics import EngineCollector, WorkerMetrics
from workers.server.service import WorkerService

log = logging.getLogger(__name__)


def build_worker(
    model_dir: Path,
    engine_config: EngineConfig,
    config: WorkerConfig,
    make_engine: Callable[[], LLMEngine] | None = None,
    on_engine: Callable[[AsyncEngine], None] | None = None,
):
    """The app and its service; the model loads in a thread once the app starts.

    `make_engine` builds the engine in that thread (None: `LLMEngine.from_pretrained`);
    `on_engine` sees the AsyncEngine before it starts (a shard group's failure hook).
    """
    if not config.served_model_names:
        config.served_model_names = [model_dir.name]
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, config.served_model_names[0])
    service = WorkerService(config, metrics)
    registry.register(
        EngineCollector(lambda: service.engine.stats if service.engine else None, metrics.model)
    )

    def load() -> None:
        try:
            if make_engine is not None:
                engine = make_engine()
            else:
                engine = LLMEngine.from_pretrained(model_dir, engine_config)
        except Exception as exc:  # reported on /load and in the log; the process stays up
            log.exception("failed to load %s", model_dir)
            service.load_error = str(exc)
            return
        if engine_config.calibrate:
            try:
                calibrate(engine)
            except Exception:  # it serves uncalibrated: the step model learns live
                log.exception("calibration failed; the step model learns from live steps")
        aengine = AsyncEngine(engine)
        if on_engine is not None:
            on_engine(aengine)
        aengine.start()
        service.set_engine(aengine)
        log.info(
            "worker ready: %s serves %s (max_model_len %d, KV %d tokens)",
            model_dir,
            config.served_model_names,
            engine.max_model_len,
            engine.runner.kv_capacity_tokens,
        )

    def start_loading() -> None:
        threading.Thread(target=load, name="model-loader", daemon=True).start()

    app = create_worker_app(service, on_startup=[start_loading])
    return app, service


class _Server(uvicorn.Server):
    """uvicorn with the worker's fleet membership: announced once the server is up,
    withdrawn before it stops taking connections (however it stops)."""

    def __init__(self, config: uvicorn.Config, join: FleetJoin | None) -> None:
        super().__init__(config)
        self.join = join

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.join is not None and self.started:
            await self.join.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.join is not None:
            await self.join.leave()
        await super().shutdown(sockets)


def serve_worker(
    model_dir: Path,
    engine_config: EngineConfig,
    config: WorkerConfig,
    host: str,
    port: int,
    make_engine: Callable[[], LLMEngine] | None = None,
    on_engine: Callable[[AsyncEngine], None] | None = None,
    join: JoinConfig | None = None,
) -> int:
    """Serve until stopped or drained (exit status 0), or until the engine dies (1).
    `join`: announce the worker as a member of a pool in the fleet's Redis meanwhile."""
    # The engine thread runs Python between torch kernels; with the default 5 ms GIL
    # switch interval the event loop could wait that long to send a ready token.
    sys.setswitchinterval(0.0005)
    app, service = build_worker(model_dir, engine_config, config, make_engine, on_engine)
    membership = None
    if join is not None:
        membership = FleetJoin(join, service)
        service.drain_listeners.append(membership.kick)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            lifespan="on",
            timeout_graceful_shutdown=30,
            # The process's own logging (format, level); no line per request: the gateway
            # polls /load several times a second.
            log_config=None,
            access_log=False,
            # asyncio and h11, not uvloop and httptools (which uvicorn picks where they are
            # installed, as they are for the gateway): beside the engine thread, uvloop cut
            # the worker's streaming throughput to 63% of in-process against 91% on asyncio
            # (`switchyard bench worker`, one run each on this machine).
            loop="asyncio",
            http="h11",
        ),
        membership,
    )

    def exit_now() -> None:
        server.should_exit = True

    failed = threading.Event()

    def exit_failed() -> None:  # from the engine thread; in-flight requests got errors
        failed.set()
        # /ready answers 503 `stalled` a moment first, so a poller sees why it went away.
        delay = threading.Timer(config.failure_exit_delay_s, exit_now)
        delay.daemon = True
        delay.start()

    service.on_drained = exit_now
    service.on_engine_failure = exit_failed
    try:
        server.run()  # re-raises a SIGINT it caught as KeyboardInterrupt once it is done
    finally:
        if service.engine is not None:
            service.engine.shutdown()
    if failed.is_set():
        log.critical("exiting with status 1: the engine failed")
        return 1
    return 0
