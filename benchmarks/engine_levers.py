"""The `levers` scenario of `switchyard bench engine`: what each CPU fast path of the
decode step is worth, switched on and off inside one process.

One engine per batch size runs decode steps while the levers are toggled in turn
(round-robin, a few steps each, many rounds), so every configuration sees the same
machine, the same contexts and the same noise: on a shared machine, separate processes
minutes apart differ by more than the levers do. Configurations:

- `fast path`: everything on (the engine's defaults on a CPU);
- `dense weights`: linear weights through `F.linear` instead of oneDNN-packed;
- `torch ops`: RMSNorm, rotary and SiLU x gate as torch ops, not the fused kernels;
- `torch attention`: workspace decode attention in SDPA, not the native kernel;
- `all torch`: all three off.
"""

import time
from dataclasses import dataclass

import torch

from benchmarks.stats import markdown_table, percentile

CONFIGS = ["fast path", "dense weights", "torch ops", "torch attention", "all torch"]


@dataclass
class _Parts:
    """The swappable parts of one engine: each lever's on and off values."""

    packed: object
    dense: object
    native_ops: object
    torch_ops: object
    kernel: object

    def apply(self, engine, config: str) -> None:
        from workers.model import dense_linear, packed_linear

        model, runner = engine.runner.model, engine.runner
        dense = config in ("dense weights", "all torch")
        model.weights = self.dense if dense else self.packed
        model.linear = dense_linear if dense else packed_linear
        model.ops = self.torch_ops if config in ("torch ops", "all torch") else self.native_ops
        torch_attn = config in ("torch attention", "all torch")
        runner.decode_kernel = None if torch_attn else self.kernel


def _unpacked(weights):
    from dataclasses import replace

    from workers.model import ModelWeights

    def dense(w: torch.Tensor) -> torch.Tensor:
        return w.to_dense() if w.is_mkldnn else w

    layers = [
        replace(
            layer,
            qkv=dense(layer.qkv),
            o=dense(layer.o),
            gate_up=dense(layer.gate_up),
            down=dense(layer.down),
        )
        for layer in weights.layers
    ]
    return ModelWeights(weights.embed, layers, weights.norm, dense(weights.lm_head))


def fast_path_parts(engine) -> _Parts | None:
    """The levers of an engine built with the CPU fast path on; None if it is not."""
    from workers.model import TorchOps

    runner, model = engine.runner, engine.runner.model
    if not (runner.packed and runner.fused_ops and runner.decode_kernel is not None):
        return None
    return _Parts(
        model.weights,
        _unpacked(model.weights),
        model.ops,
        TorchOps(model.cfg.rms_norm_eps),
        runner.decode_kernel,
    )


def _levers_point(spec: dict, batch: int) -> dict:
    from benchmarks.engine_systems import _engine, greedy_params

    ctx, rounds, per = spec["decode_context"], spec["rounds"], spec["steps_per_round"]
    total = rounds * per * len(CONFIGS) + 4
    engine = _engine(
        spec["ckpt"],
        num_blocks=batch * (ctx + total + 8) // 16 + 64,
        budget=4096,
        max_seqs=batch,
        dtype=spec["dtype"],
    )
    parts = fast_path_parts(engine)
    if parts is None:
        return {"batch": batch, "error": "the CPU fast path is not on in this engine"}
    runner = engine.runner
    gen = torch.Generator().manual_seed(7)
    vocab = runner.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(3, vocab, (ctx,), generator=gen).tolist()
        engine.add_request(f"l{i}", prompt_token_ids=prompt, params=greedy_params(total + 8))
    while engine.scheduler.num_running < batch or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(rounds):
        for config in CONFIGS:
            parts.apply(engine, config)
            engine.step()  # the first step after a switch is not timed
            for _ in range(per - 1):
                t = time.perf_counter()
                engine.step()
                times[config].append(time.perf_counter() - t)
    parts.apply(engine, "fast path")
    step_ms = {c: percentile(t, 50) * 1e3 for c, t in times.items()}
    return {"batch": batch, "step_ms": step_ms}


def run_levers(spec: dict) -> dict:
    return {
        "dtype": spec["dtype"],
        "decode_context": spec["decode_context"],
        "points": [_levers_point(spec, b) for b in spec["batches"]],
    }


def levers_section(lev: dict) -> list[str]:
    rows = []
    for p in lev["points"]:
        if "error" in p:
            rows.append({"batch": p["batch"], "fast path": p["error"]})
            continue
        ms = p["step_ms"]
        row = {"batch": p["batch"], "fast path": f"{ms['fast path']:.2f}"}
        for c in CONFIGS[1:]:
            row[c] = f"{ms[c]:.2f} ({ms[c] / ms['fast path']:.2f}x)"
        rows.append(row)
    cols = [("batch", "decode batch")] + [(c, f"{c} ms") for c in CONFIGS]
    return [
        f"\n## What each CPU lever is worth ({lev['dtype']}), decode steps in one process\n",
        f"Median step time, context ~{lev['decode_context']} tokens; each lever switched off "
        "in turn, round-robin in one engine (in brackets: that step time / the fast path's).\n",
        markdown_table(rows, cols),
    ]
