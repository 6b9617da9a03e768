"""Shard-group settings: one dataclass, defaults here, filled by the entry points."""

from dataclasses import dataclass


@dataclass
class ShardConfig:
    """How a worker splits its model over devices (`tensor_parallel` ranks)."""

    tensor_parallel: int = 1  # ranks (devices); 1 = no shard group
    # NCCL on CUDA devices, gloo on CPU; None = chosen from the engine's device.
    backend: str | None = None
    # Any collective (a step's all-reduce, a heartbeat) not done in this long fails the
    # whole group: /ready answers `stalled` and the worker exits non-zero.
    collective_timeout_s: float = 10.0
    # Rank 0 pings the others when it has sent them nothing for this long, so a dead or
    # hung rank is noticed while the worker is idle too.
    heartbeat_s: float = 0.5
    # Joining the group and loading the shards (every rank) must finish within this.
    start_timeout_s: float = 600.0
