"""Tensor parallelism: one model split over N devices (a shard group), served as one worker.

Attention heads and MLP columns are sharded (column-parallel in, row-parallel out, one
all-reduce after attention and one after the MLP of each layer); the embedding and the
output head are sharded by vocabulary. Rank 0 runs the scheduler and the sampler and
broadcasts each step's batch; every rank runs its shard of the forward pass.

- `config.py`: `ShardConfig` (size, timeouts).
- `plan.py`: what a rank holds (pure; refuses shapes that cannot be split).
- `group.py`: the `torch.distributed` group, collectives with timeouts, the step protocol.
- `loader.py`: reads only this rank's slices of the safetensors.
- `runner.py`: `ShardedRunner`, the model runner of one rank (rank 0 drives, others follow).
- `launch.py`: starting the other ranks, watching them, stopping them.
- `follower.py`: the process of a rank other than 0 (`python -m workers.tp.follower`).
"""
