"""Make a checkpoint's pre-quantized weights (`switchyard models fetch --quantize int8|q4`):
the matrices the runner would quantize at load, written once beside it (`quant_files`).

Each matrix is quantized from the checkpoint's stored floats exactly as at load
(`quant.quantize`), so the runner computes the same either way; with `gguf` (the GGUF the
float checkpoint was converted from, `workers.models.gguf_convert`), a q4 matrix the GGUF
holds as Q4_0 or Q4_1 blocks is taken from them instead (`gguf_blocks`), with no float in
between. A Q4_1 GGUF's float32 conversion quantizes back to its own blocks, so those are
the same bits as at load; a Q4_0 block keeps its exact values (w = d (q - 8)), which
quantizing its floats again would round to Q4_1's d and m. What the GGUF holds in another
type (Q6_K, Q8_0, F16: often the output and the embedding) is quantized from the floats.
"""

import collections
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from workers.models.fingerprint import model_fingerprint
from workers.models.model_config import load_model_config
from workers.runner import quant_files
from workers.runner.gguf_blocks import GGUFBlocks
from workers.runner.loader import safetensors_files
from workers.runner.quant import QuantizedWeight, quantize

log = logging.getLogger(__name__)

KINDS = ("int8", "q4")
# The checkpoint's tensors each fused matrix is made of, in row order (the loader's).
_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


@dataclass(frozen=True)
class PrequantizeResult:
    """What `prequantize` wrote."""

    path: Path  # the safetensors file
    size_bytes: int
    origin: str  # `quant_files.describe_origin`: how many tensors came from where
    seconds: float


def prequantize(
    model_dir: Path, kind: str, gguf: Path | None = None, show_progress: bool = True
) -> PrequantizeResult:
    """Write `model_dir`'s linear weights quantized to `kind` beside it. `gguf`: the file
    the checkpoint was converted from, whose Q4_0 / Q4_1 blocks a q4 copy keeps as they are
    (ignored for int8). Raises ValueError for an unknown `kind`."""
    if kind not in KINDS:
        raise ValueError(f"--quantize must be one of {', '.join(KINDS)}, not {kind!r}")
    t0 = time.perf_counter()
    cfg = load_model_config(model_dir)
    fingerprint = model_fingerprint(model_dir)  # before reading: what the floats were
    blocks = GGUFBlocks(gguf, cfg) if gguf is not None and kind == "q4" else None
    sources: collections.Counter[str] = collections.Counter()
    matrices: dict[str, QuantizedWeight] = {}
    files: dict[str, safe_open] = {}
    for path in safetensors_files(model_dir):
        f = safe_open(str(path), framework="pt")
        files.update({name: f for name in f.keys()})  # noqa: SIM118 (not a mapping)
    shapes = quant_files.matrix_shapes(cfg)
    total = sum(len(p) for p in _PARTS.values()) * cfg.num_layers + 1
    with tqdm(
        total=total, desc=f"quantize {model_dir.name} {kind}", unit="tensor",
        disable=not show_progress,
    ) as bar:  # fmt: skip

        def one(hf_name: str, as_kind: str) -> QuantizedWeight:
            if hf_name not in files:
                raise ValueError(f"{model_dir}: tensor {hf_name!r} is missing")
            qw = None
            if blocks is not None and as_kind == "q4":
                qw = blocks.q4(hf_name, _shape(files[hf_name], hf_name))
                if qw is not None:
                    sources[f"from the GGUF's {blocks.block_type(hf_name)} blocks"] += 1
            if qw is None:
                qw = quantize(files[hf_name].get_tensor(hf_name), as_kind)
                sources[f"quantized to {as_kind} from the checkpoint's floats"] += 1
            bar.update()
            return qw

        for i in range(cfg.num_layers):
            for matrix, parts in _PARTS.items():
                qws = [one(f"model.layers.{i}.{p}.weight", kind) for p in parts]
                matrices[f"layers.{i}.{matrix}"] = _concat_rows(qws)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        matrices["lm_head"] = one(head, "int8")  # int8 in both kinds, as at load
    for name, qw in matrices.items():
        if qw.shape != shapes[name]:
            raise ValueError(f"{model_dir}: {name} is {qw.shape}, expected {shapes[name]}")
    origin = quant_files.describe_origin(sources)
    path = quant_files.save(model_dir, kind, matrices, sources, fingerprint)
    size = path.stat().st_size
    seconds = time.perf_counter() - t0
    log.info(
        "wrote %s weights of %s to %s (%.1f MiB: %s) in %.1fs",
        kind, model_dir, path, size / 2**20, origin, seconds,
    )  # fmt: skip
    return PrequantizeResult(path, size, origin, seconds)


def _shape(f: "safe_open", hf_name: str) -> tuple[int, int]:
    shape = f.get_slice(hf_name).get_shape()
    return (int(shape[0]), int(shape[-1]))


def _concat_rows(qws: list[QuantizedWeight]) -> QuantizedWeight:
    """Matrices of one kind and width stacked by rows, as the loader fuses q/k/v and
    gate/up: each row's values and scales are its own, so quantizing the parts apart is
    quantizing the fused matrix."""
    if len(qws) == 1:
        return qws[0]
    first = qws[0]
    scales = [q.scales for q in qws if q.scales is not None]
    mins = [q.mins for q in qws if q.mins is not None]
    return QuantizedWeight(
        first.kind,
        (sum(q.shape[0] for q in qws), first.shape[1]),
        torch.cat([q.data for q in qws]),
        torch.cat(scales),
        torch.cat(mins) if mins else None,
    )
