"""One rank's view of the sharded model: its slice plan, its weights, its collectives.

`RankShard` is what `ModelRunner(shard=...)` and `CausalLM(tp=...)` are given: it loads
this rank's weights, shrinks the model config to this rank's heads and columns, and
implements the three collectives of the forward pass (`workers.runner.ops.ShardOps`).
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from workers.models.model_config import ModelConfig
from workers.runner.model import ModelWeights
from workers.tp.group import ShardGroup
from workers.tp.loader import load_shard
from workers.tp.plan import ShardPlan, local_config, make_plan


class RankShard:
    def __init__(self, group: ShardGroup) -> None:
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.plan: ShardPlan | None = None
        self.vocab_size = 0

    # -- for the runner ---------------------------------------------------------------

    def load_weights(
        self, cfg: ModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device
    ) -> ModelWeights:
        self.plan = make_plan(cfg, self.rank, self.size)
        self.vocab_size = cfg.vocab_size
        return load_shard(cfg, self.plan, model_dir, dtype, device)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        return local_config(cfg, self.size)

    def agree_min(self, value: int) -> int:
        return self.group.agree_min(value, self.group.config.start_timeout_s)

    # -- for the forward pass (workers.runner.ops.ShardOps) ----------------------------------

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        assert self.plan is not None
        start, stop = self.plan.vocab_rows
        local = input_ids - start
        outside = (input_ids < start) | (input_ids >= stop)
        h = F.embedding(local.masked_fill(outside, 0), weight)
        # Exactly one rank holds each token's row; the others add zeros, so the sum is exact.
        return self.group.all_reduce(h.masked_fill(outside[:, None], 0.0))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(logits)[:, : self.vocab_size]
