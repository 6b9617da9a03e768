"""`switchyard worker --tensor-parallel N`: one worker over a shard group of N ranks.

This process is rank 0: it serves HTTP and drives the scheduler; ranks 1..N-1 are its
child processes. The group is one failure unit: when any rank dies or hangs (a process
exit, or a collective or heartbeat past `collective_timeout_s`), the engine is failed,
in-flight requests get errors, `/ready` answers 503 `stalled`, and the process exits
with status 1 after stopping the other ranks, so a supervisor restarts the group whole.
"""

import logging
import os
import sys
from pathlib import Path

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.server.config import WorkerConfig
from workers.server.join import JoinConfig
from workers.server.main import serve_worker
from workers.tp.config import ShardConfig
from workers.tp.group import ShardGroupError
from workers.tp.launch import ShardGroupLauncher

log = logging.getLogger(__name__)


def serve_sharded_worker(
    model_dir: Path,
    engine_config: EngineConfig,
    config: WorkerConfig,
    shard_config: ShardConfig,
    host: str,
    port: int,
    log_level: str = "info",
    join: JoinConfig | None = None,
) -> int:
    """Serve until stopped or drained (0), or until the engine or the group fails (1).
    Raises ShardingError (before starting anything) for a model that cannot be split.
    `join`: announce the worker as a pool member in the fleet's Redis meanwhile."""
    launcher = ShardGroupLauncher(model_dir, engine_config, shard_config, log_level)

    def make_engine() -> LLMEngine:
        try:
            return launcher.build_engine()
        except ShardGroupError as exc:  # reported like any load failure
            raise RuntimeError(f"the shard group failed while loading: {exc}") from exc

    def on_engine(aengine: AsyncEngine) -> None:
        launcher.on_failure(aengine.fail)

    code = 1
    try:
        code = serve_worker(
            model_dir,
            launcher.engine_config,
            config,
            host,
            port,
            make_engine,
            on_engine,
            join=join,
        )
    finally:
        launcher.close()
    if launcher.failed:
        why = launcher.error or (launcher.group.failed if launcher.group else None)
        log.critical("exiting with status 1: the shard group failed (%s)", why)
        sys.stdout.flush()
        sys.stderr.flush()
        # A timed-out collective may still hold gloo's threads; do not wait on them.
        os._exit(1)
    return code
