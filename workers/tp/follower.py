"""The process of one rank other than 0: join the group, load the shard, follow rank 0.

`python -m workers.tp.follower SPEC_JSON` (started by `workers.tp.launch`). Exits 0 when
rank 0 sends STOP, 1 when the group fails (rank 0 gone or silent past the timeout).
"""

import json
import logging
import os
import sys
from pathlib import Path

from workers.engine.config import EngineConfig, SchedulerConfig
from workers.tp.config import ShardConfig
from workers.tp.group import ShardGroup, ShardGroupError
from workers.tp.launch import pin_to
from workers.tp.runner import ShardedRunner

log = logging.getLogger("workers.tp.follower")


def run(spec: dict) -> int:
    engine = dict(spec["engine"])
    engine["scheduler"] = SchedulerConfig(**(engine.get("scheduler") or {}))
    engine_config = EngineConfig(**engine)
    config = ShardConfig(**spec["shard"])
    rank = spec["rank"]
    pin_to(spec.get("cpus"))  # this rank's own cores, before its threads start
    import torch

    device = torch.device(engine_config.device)
    try:
        group = ShardGroup(rank, config.tensor_parallel, spec["store_port"], config, device)
        runner = ShardedRunner(Path(spec["model_dir"]), engine_config, group)
        runner.follow()
    except ShardGroupError as exc:
        log.critical("rank %d: the shard group failed, exiting: %s", rank, exc)
        return 1
    except Exception:  # a load error: rank 0 sees this rank leave the group
        log.exception("rank %d failed", rank)
        return 1
    group.close()
    return 0


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(
        level=spec.get("log_level", "info").upper(),
        format=f"%(asctime)s %(levelname)s rank{spec['rank']} %(name)s: %(message)s",
    )
    code = run(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed group may still hold gloo threads that would block interpreter shutdown.
    os._exit(code)


if __name__ == "__main__":
    main()
