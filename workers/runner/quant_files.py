"""Pre-quantized linear weights on disk: written once beside a checkpoint
(`switchyard models fetch --quantize int8|q4`, `workers.runner.prequantize`) and read by
the runner in place of quantizing at load.

    <model_dir>.quantized/<kind>.safetensors   the linear matrices in quant.py's plain layout
    <model_dir>.quantized/<kind>.json          the manifest, written last

Each matrix the runner holds (`layers.<i>.qkv`, `.o`, `.gate_up`, `.down`, and `lm_head`,
int8 in both kinds as at load) is `<name>.q` (int8 q, or q4's nibbles two a byte), `<name>.scales`
and, for q4, `<name>.mins`. The manifest names the kind, the layout version and the float
checkpoint's fingerprint (`workers.models.fingerprint`): a file whose manifest does not match
the checkpoint as it is now is not used (a warning says why) and the runner quantizes at load.

Beside the checkpoint's directory, not inside: the fingerprint covers every weight file
under it (it is also what a pool member announces), so a copy inside would change the
fingerprint it is checked against, and a host that pre-quantized would announce another
model than one that did not, for the same weights.
"""

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from workers.models.fetch import quantized_dir
from workers.models.fingerprint import model_fingerprint
from workers.models.model_config import ModelConfig
from workers.runner.quant import Q4_GROUP, QuantizedWeight

log = logging.getLogger(__name__)

LAYOUT = 1  # of the file; a change makes older files stale


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each linear matrix the runner holds, by name, and its [out, in] shape (fused as the
    loader fuses them)."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {}
    for i in range(cfg.num_layers):
        shapes[f"layers.{i}.qkv"] = (q_size + 2 * kv_size, hidden)
        shapes[f"layers.{i}.o"] = (hidden, q_size)
        shapes[f"layers.{i}.gate_up"] = (2 * inter, hidden)
        shapes[f"layers.{i}.down"] = (hidden, inter)
    shapes["lm_head"] = (cfg.vocab_size, hidden)
    return shapes


@dataclass(frozen=True)
class Prequantized:
    """Linear matrices read from a pre-quantized file, and what to say of them."""

    kind: str  # "int8" | "q4"
    matrices: dict[str, QuantizedWeight]  # by `matrix_shapes` name, plain layout
    path: Path  # the safetensors file
    origin: str  # how they were made (`describe_origin` of the manifest's "tensors")


def save(
    model_dir: Path,
    kind: str,
    matrices: Mapping[str, QuantizedWeight],
    tensors: Mapping[str, int],
    fingerprint: str,
) -> Path:
    """Write `matrices` (plain layout) as `model_dir`'s pre-quantized `kind` weights, made
    from the checkpoint whose fingerprint is `fingerprint`; `tensors`: how many of the
    checkpoint's tensors came from where; returns the safetensors file.
    The manifest goes last, so a file without one (a write cut short) is never read."""
    out = quantized_dir(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    stored: dict[str, torch.Tensor] = {}
    for name, qw in matrices.items():
        if qw.tiled or qw.kind != ("int8" if name == "lm_head" else kind):
            raise ValueError(f"{name}: a {qw.kind} weight (tiled {qw.tiled}) in a {kind} file")
        stored[f"{name}.q"] = qw.data.contiguous().cpu()
        for part, t in (("scales", qw.scales), ("mins", qw.mins)):
            if t is not None:
                stored[f"{name}.{part}"] = t.contiguous().cpu()
    weights, manifest = out / f"{kind}.safetensors", out / f"{kind}.json"
    manifest.unlink(missing_ok=True)  # the old file is stale from here on
    tmp = out / f".{kind}.safetensors.tmp-{os.getpid()}"
    save_file(stored, str(tmp), metadata={"kind": kind, "layout": str(LAYOUT)})
    tmp.chmod(0o644)  # safetensors writes 0600; the checkpoint's other files are readable
    os.replace(tmp, weights)
    record = {
        "kind": kind,
        "layout": LAYOUT,
        "checkpoint_fingerprint": fingerprint,
        "checkpoint": str(model_dir.resolve()),
        "file": weights.name,
        "size_bytes": weights.stat().st_size,
        "tensors": dict(tensors),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp_manifest = out / f".{kind}.json.tmp-{os.getpid()}"
    tmp_manifest.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp_manifest, manifest)
    return weights


def describe_origin(tensors: Mapping[str, int]) -> str:
    """The manifest's counts in words ("210 tensors from the GGUF's Q4_1 blocks, ...")."""
    return ", ".join(
        f"{n} {'tensor' if n == 1 else 'tensors'} {source}" for source, n in sorted(tensors.items())
    )


def load(model_dir: Path, kind: str, cfg: ModelConfig, device: torch.device) -> Prequantized | None:
    """`model_dir`'s pre-quantized `kind` weights on `device`; None where there are none
    (quietly) or they do not match the checkpoint as it is now (with a warning saying why)."""
    out = quantized_dir(model_dir)
    manifest_path = out / f"{kind}.json"
    if not manifest_path.is_file():
        return None
    path = out / f"{kind}.safetensors"
    why = _stale(manifest_path, model_dir, kind, path)
    if why is None:
        try:
            matrices = _read(path, kind, matrix_shapes(cfg), device)
        except (OSError, ValueError, SafetensorError) as exc:  # a file cut short, or altered
            why = str(exc)
        else:
            tensors = json.loads(manifest_path.read_text()).get("tensors")
            origin = describe_origin(tensors) if isinstance(tensors, dict) else "origin unknown"
            return Prequantized(kind, matrices, path, origin)
    log.warning(
        "not using the pre-quantized %s weights in %s: %s; quantizing at load", kind, out, why
    )
    return None


def _stale(manifest_path: Path, model_dir: Path, kind: str, path: Path) -> str | None:
    """Why the manifest does not describe `model_dir`'s `kind` weights in `path` now; None
    if it does."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if not isinstance(manifest, dict):
        return "unreadable manifest (not an object)"
    if manifest.get("kind") != kind or manifest.get("layout") != LAYOUT:
        return (
            f"made as {manifest.get('kind')!r} layout {manifest.get('layout')!r}, "
            f"not {kind!r} layout {LAYOUT}"
        )
    size = path.stat().st_size if path.is_file() else None
    if size != manifest.get("size_bytes"):
        return f"{path.name} is {size} bytes, the manifest says {manifest.get('size_bytes')}"
    now = model_fingerprint(model_dir)
    if manifest.get("checkpoint_fingerprint") != now:
        return (
            f"made from checkpoint {manifest.get('checkpoint_fingerprint')!r}, and the "
            f"checkpoint is {now!r} now (fetch --quantize again)"
        )
    return None


def _read(
    path: Path, kind: str, shapes: dict[str, tuple[int, int]], device: torch.device
) -> dict[str, QuantizedWeight]:
    """Every matrix of `shapes` from `path`, checked against the layout it must have."""
    matrices = {}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for name, (n, k) in shapes.items():
            as_kind = "int8" if name == "lm_head" else kind
            parts = ("q", "scales") if as_kind == "int8" else ("q", "scales", "mins")
            missing = [p for p in parts if f"{name}.{p}" not in names]
            if missing:
                raise ValueError(f"{path.name} lacks {name}'s {', '.join(missing)}")
            got = {p: f.get_tensor(f"{name}.{p}") for p in parts}
            g = -(-k // Q4_GROUP)
            want = (
                {"q": ((n, k), torch.int8), "scales": ((n,), torch.float32)}
                if as_kind == "int8"
                else {
                    "q": ((n, g * Q4_GROUP // 2), torch.uint8),
                    "scales": ((n, g), torch.float16),
                    "mins": ((n, g), torch.float16),
                }
            )
            for p, (shape, dtype) in want.items():
                t = got[p]
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"{path.name}: {name}.{p} is {t.dtype} {tuple(t.shape)}, "
                        f"expected {dtype} {shape}"
                    )
            matrices[name] = QuantizedWeight(
                as_kind,
                (n, k),
                got["q"].to(device),
                got["scales"].to(device),
                got["mins"].to(device) if "mins" in got else None,
            )
    return matrices
