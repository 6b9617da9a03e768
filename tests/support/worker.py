"""Run the real worker app under uvicorn on a loopback port, in a background thread."""

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.server.app import create_worker_app
from workers.server.config import WorkerConfig
from workers.server.metrics import EngineCollector, WorkerMetrics
from workers.server.service import WorkerService


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningWorker:
    def __init__(self, url: str, service: WorkerService, engine: LLMEngine) -> None:
        self.url = url
        self.service = service
        self.engine = engine
        self._gate: threading.Event | None = None

    def stall(self) -> None:
        """Block the engine thread inside its next model step (a stuck device, say)."""
        gate = threading.Event()
        runner = self.engine.runner
        original = runner.execute

        def stuck(*args, **kwargs):
            gate.wait(30)
            runner.execute = original
            return original(*args, **kwargs)

        runner.execute = stuck
        self._gate = gate

    def unstall(self) -> None:
        if self._gate is not None:
            self._gate.set()


@contextmanager
def running_worker(
    model_dir: Path,
    num_kv_blocks: int = 256,
    max_num_seqs: int = 16,
    itl_target_s: float | None = None,
    calibrate: bool = False,
    **worker_kw,
):
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=512, itl_target_s=itl_target_s
    )
    engine = LLMEngine.from_pretrained(
        model_dir, EngineConfig(num_kv_blocks=num_kv_blocks, block_size=16, scheduler=scheduler)
    )
    if calibrate:  # as `switchyard worker` does before it reports ready
        from workers.engine.calibration import calibrate as run_calibration

        run_calibration(engine)
    aengine = AsyncEngine(engine)
    aengine.start()
    config = WorkerConfig(served_model_names=["small", "demo"], **worker_kw)
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "small")
    service = WorkerService(config, metrics, aengine)
    registry.register(EngineCollector(lambda: aengine.stats, "small"))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_worker_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    service.on_drained = lambda: setattr(server, "should_exit", True)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    worker = RunningWorker(f"http://127.0.0.1:{port}", service, engine)
    try:
        yield worker
    finally:
        worker.unstall()
        server.should_exit = True
        thread.join(5)
        aengine.shutdown()
