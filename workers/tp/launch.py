"""Starting a shard group from rank 0: the store, the other ranks' processes, the
heartbeat, and stopping them all together.

Rank 0 is the process that serves (or the bench, or a test). It opens the TCP store on
127.0.0.1 (a free port chosen by the OS), starts ranks 1..N-1 as child processes
(`python -m workers.tp.follower`), joins the group and loads its own shard. The children
get a parent-death signal, so they never outlive rank 0, and rank 0 watches them: one
that exits or stops answering fails the whole group.
"""

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.model_config import load_model_config
from workers.runner.plan import num_cpus, plan_threads
from workers.tp.config import ShardConfig
from workers.tp.group import STOP, HeartbeatThread, ShardGroup, ShardGroupError, rank_device
from workers.tp.plan import check_shardable
from workers.tp.runner import ShardedRunner

log = logging.getLogger(__name__)


def rank_engine_config(config: EngineConfig, rank: int, size: int) -> EngineConfig:
    """Rank r's engine settings: its own device; on a CPU the threads split over ranks."""
    threads = config.threads
    if threads is None and rank_device(config.device, 0).type == "cpu":
        threads = max(plan_threads(None, num_cpus()) // size, 1)
    return dataclasses.replace(
        config, device=str(rank_device(config.device, rank)), threads=threads
    )


def rank_cpus(size: int) -> list[list[int]] | None:
    """The CPUs this process may run on, split into `size` adjacent slices, one per rank,
    so that a shard group placed on its own cores (`workers.fleet.devices`) gives each
    rank its own; None when there are fewer CPUs than ranks (nothing to split) or no
    affinity on this platform. Leftover CPUs (not a multiple of `size`) go unused."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    k = len(cpus) // size
    if k < 1:
        return None
    return [cpus[r * k : (r + 1) * k] for r in range(size)]


def pin_to(cpus: list[int] | None) -> None:
    """Run this process on `cpus` from now on (None: leave it)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ShardGroupLauncher:
    """Rank 0's handle on its shard group.

    Create it on the thread that will outlive the group (the main thread): the children's
    parent-death signal follows the thread that started them. `build_runner` may run on
    any thread (a loader). `close` stops the other ranks (STOP, then SIGTERM, SIGKILL).
    """

    def __init__(
        self,
        model_dir: Path,
        engine_config: EngineConfig,
        config: ShardConfig,
        log_level: str = "info",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.size = config.tensor_parallel
        check_shardable(load_model_config(self.model_dir), self.size)
        self.engine_config = rank_engine_config(engine_config, 0, self.size)
        start = timedelta(seconds=config.start_timeout_s)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, timeout=start, wait_for_workers=False
        )
        self.procs: list[subprocess.Popen] = []
        on_cpu = rank_device(engine_config.device, 0).type == "cpu"
        slices = rank_cpus(self.size) if on_cpu else None
        for rank in range(1, self.size):
            spec = {
                "model_dir": str(self.model_dir),
                "engine": dataclasses.asdict(rank_engine_config(engine_config, rank, self.size)),
                "shard": dataclasses.asdict(config),
                "rank": rank,
                "store_port": self.store.port,
                "log_level": log_level,
                "cpus": slices[rank] if slices else None,
            }
            argv = [sys.executable, "-m", "workers.tp.follower", json.dumps(spec)]
            self.procs.append(
                subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            )
        # Rank 0 is this process: pinned after the others inherited the whole set, and
        # given its cores back on close (a process that outlives its group, a test's).
        self._cpus_before = sorted(os.sched_getaffinity(0)) if slices else None
        pin_to(slices[0] if slices else None)
        log.info(
            "shard group of %d: rank 0 is pid %d, ranks 1..%d are pids %s (store 127.0.0.1:%d)",
            self.size,
            os.getpid(),
            self.size - 1,
            [p.pid for p in self.procs],
            self.store.port,
        )
        self.group: ShardGroup | None = None
        self.heartbeat: HeartbeatThread | None = None
        self.error: BaseException | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._lock = threading.Lock()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def build_runner(self) -> ShardedRunner:
        """Join the group and load rank 0's shard (every rank loads at once); then the
        heartbeat starts, so the others hear from rank 0 while its engine is built."""
        device = rank_device(self.engine_config.device, 0)
        self.group = ShardGroup(0, self.size, self.store.port, self.config, device, self.store)
        runner = ShardedRunner(self.model_dir, self.engine_config, self.group)
        self.heartbeat = HeartbeatThread(self.group, self._failed, self.rank_exited)
        self.heartbeat.start()
        return runner

    def build_engine(self) -> LLMEngine:
        """`build_runner`, then the engine around it (rank 0 schedules and samples)."""
        from workers.engine.tokenizer import CheckpointTokenizer

        runner = self.build_runner()
        has_tok = (self.model_dir / "tokenizer.json").is_file()
        tokenizer = CheckpointTokenizer(self.model_dir) if has_tok else None
        return LLMEngine(runner, tokenizer, self.engine_config)

    def rank_exited(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"rank {rank} (pid {proc.pid}) exited with status {code}"
        return None

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` once when the group fails (now, if it already has)."""
        with self._lock:
            error = self.error
            self._on_failure = callback
        if error is not None:
            callback(error)

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            callback = self._on_failure
        if callback is not None:
            callback(error)

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.group is not None and self.group.failed is not None)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every other rank: STOP when the group is healthy, then signals."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        group = self.group
        if group is not None and not self.failed and self.rank_exited() is None:
            try:
                group.send(STOP)
            except ShardGroupError as exc:
                log.warning("could not stop the other ranks cleanly: %s", exc)
        failed = self.failed
        for proc in self.procs:
            try:
                proc.wait(0.5 if failed else grace_s)
            except subprocess.TimeoutExpired:
                # A failed group's ranks may be hung (stopped, stuck in a collective).
                if failed:
                    proc.kill()
                else:
                    proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        if group is not None:
            group.close()
        pin_to(self._cpus_before)
        self._cpus_before = None


def sharded_engine(
    model_dir: Path, engine_config: EngineConfig, config: ShardConfig
) -> tuple[LLMEngine, ShardGroupLauncher]:
    """An offline engine over a shard group (tests, benches): call `launcher.close()`."""
    launcher = ShardGroupLauncher(model_dir, engine_config, config)
    try:
        return launcher.build_engine(), launcher
    except BaseException:
        launcher.close(grace_s=2.0)
        raise
