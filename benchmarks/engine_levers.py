"""The `levers` scenario of `switchyard bench engine`: what each CPU fast path of the
decode step is worth, switched on and off inside one process.

One engine per batch size runs decode steps while the levers are toggled in turn
(round-robin, a few steps each, many rounds), so every configuration sees the same
machine, the same contexts and the same noise: on a shared machine, separate processes
minutes apart differ by more than the levers do. Configurations:

- `fast path`: everything on (the engine's defaults on a CPU);
- `oneDNN weights`: the same weights packed for oneDNN instead of for our linear
  kernel (`workers.runner.native.linear`); the fast path where that kernel is off; where oneDNN
  cannot run the dtype (bf16 on an AVX2 CPU) the same as `dense weights`;
- `dense weights`: linear weights through `F.linear` instead of packed;
- `torch ops`: RMSNorm, rotary and SiLU x gate as torch ops, not the fused kernels;
- `torch attention`: workspace decode attention in SDPA, not the native kernel;
- `all torch`: all three off.
"""

import time
from dataclasses import dataclass

from benchmarks.stats import markdown_table, percentile

CONFIGS = [
    "fast path",
    "oneDNN weights",
    "dense weights",
    "torch ops",
    "torch attention",
    "all torch",
]


@dataclass
class _Parts:
    """The swappable parts of one engine: each lever's on and off values."""

    packed: object
    onednn: object  # the weights in oneDNN's layout (the packed ones if they are already)
    dense: object
    native_ops: object
    torch_ops: object
    kernel: object

    def apply(self, engine, config: str) -> None:
        from workers.runner.packing import dense_linear, packed_linear

        model, runner = engine.runner.model, engine.runner
        dense = config in ("dense weights", "all torch")
        model.weights = self.packed
        if dense:
            model.weights = self.dense
        elif config == "oneDNN weights":
            model.weights = self.onednn
        model.linear = dense_linear if dense else packed_linear
        model.ops = self.torch_ops if config in ("torch ops", "all torch") else self.native_ops
        torch_attn = config in ("torch attention", "all torch")
        runner.decode_kernel = None if torch_attn else self.kernel


def _unpacked(weights, kernel):
    """Dense [N, K] weights back from either packing."""
    from workers.runner.packing import map_linears

    def dense(w):
        if w.is_mkldnn:
            return w.to_dense()
        return kernel.unpack(w) if w.dim() > 2 else w

    return map_linears(weights, dense)


def fast_path_parts(engine) -> _Parts | None:
    """The levers of an engine built with the CPU fast path on; None if it is not."""
    from workers.runner.ops import TorchOps
    from workers.runner.packing import can_pack, pack_weights

    runner, model = engine.runner, engine.runner.model
    if not (runner.packed and runner.fused_ops and runner.decode_kernel is not None):
        return None
    dense = _unpacked(model.weights, runner.linear_kernel)
    onednn = model.weights
    if runner.linear_kernel is not None:
        onednn = pack_weights(dense, onednn=can_pack(runner.device, runner.dtype))
    return _Parts(
        model.weights,
        onednn,
        dense,
        model.ops,
        TorchOps(model.cfg.rms_norm_eps),
        runner.decode_kernel,
    )


def _levers_point(spec: dict, batch: int) -> dict:
    from benchmarks.engine_systems import decoding_engine

    ctx, rounds, per = spec["decode_context"], spec["rounds"], spec["steps_per_round"]
    total = rounds * per * len(CONFIGS) + 4
    engine = decoding_engine(spec["ckpt"], spec["dtype"], batch, ctx, total)
    parts = fast_path_parts(engine)
    if parts is None:
        return {"batch": batch, "error": "the CPU fast path is not on in this engine"}
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
        "points": [_levers_point(spec, b) for b in spec["decode_batches"]],
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
