"""Load a local Hugging Face checkpoint directory: config, safetensors shards, tokenizer."""

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from workers.errors import CheckpointError
from workers.models.model_config import ModelConfig
from workers.runner.model import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from workers.runner.quant import QuantizedWeight

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 dot products, or AMX):
    there bf16 weights read half the bytes and run at least as fast as fp32. Without them
    (AVX2 only) bf16 is widened to fp32 in every kernel, and fp32 is the default."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> str:
    """`name`, with "auto" made concrete for `device`: bfloat16 on a GPU that supports it
    (else float16) and on a CPU with native bf16 (`cpu_has_fast_bf16`), else float32."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if device.type == "cpu" and cpu_has_fast_bf16() else "float32"


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(
            f"unsupported dtype {name!r}; expected auto or one of {sorted(DTYPES)}"
        ) from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files of a checkpoint, via the index file when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir} has no *.safetensors weights (only safetensors is read)"
        )
    return files


def read_tensors(
    model_dir: Path, skip: Callable[[str], bool] = lambda name: False
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint but those `skip` names."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not skip(name):
                    tensors[name] = f.get_tensor(name)
    return tensors


_LINEAR_SUFFIXES = tuple(
    f".{m}.weight"
    for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


def is_linear_matrix(name: str) -> bool:
    """Whether checkpoint tensor `name` is one of the linear matrices quantization replaces
    (a layer's projections, the untied LM head)."""
    return name == "lm_head.weight" or (
        name.startswith("model.layers.") and name.endswith(_LINEAR_SUFFIXES)
    )


def load_weights(
    cfg: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    *,
    as_stored: bool = False,
    quantized: Mapping[str, "QuantizedWeight"] | None = None,
) -> ModelWeights:
    """Read, check shapes, fuse q/k/v and gate/up, cast and move to the device.

    `as_stored`: the linear matrices (the LM head too, tied or not) keep the checkpoint's
    dtype, to be quantized from the values stored rather than from them rounded to `dtype`
    first. `quantized`: the linear matrices, already quantized (`quant_files.load`, by
    `matrix_shapes` name); their float tensors are not read."""
    raw = read_tensors(model_dir, is_linear_matrix if quantized is not None else lambda n: False)
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def take(name: str, shape: tuple[int, ...], linear: bool = False) -> torch.Tensor:
        t = raw.get(name)
        if t is None:
            raise CheckpointError(
                f"{model_dir}: tensor {name!r} is missing (expected shape {shape})"
            )
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{model_dir}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
            )
        return t.to(device=device, dtype=None if linear and as_stored else dtype)

    def matrix(name: str, parts: list[tuple[str, tuple[int, int]]]) -> torch.Tensor:
        if quantized is not None:
            return quantized[name]  # type: ignore[return-value]  # held where tensors are
        return torch.cat([take(p, shape, linear=True) for p, shape in parts])

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = matrix(
            f"layers.{i}.qkv",
            [
                (p + "self_attn.q_proj.weight", (q_size, hidden)),
                (p + "self_attn.k_proj.weight", (kv_size, hidden)),
                (p + "self_attn.v_proj.weight", (kv_size, hidden)),
            ],
        )
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat(
                [
                    take(p + "self_attn.q_proj.bias", (q_size,)),
                    take(p + "self_attn.k_proj.bias", (kv_size,)),
                    take(p + "self_attn.v_proj.bias", (kv_size,)),
                ]
            )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight", (hidden,)),
                qkv=qkv,
                qkv_bias=bias,
                q_norm=take(p + "self_attn.q_norm.weight", (hd,)) if cfg.qk_norm else None,
                k_norm=take(p + "self_attn.k_norm.weight", (hd,)) if cfg.qk_norm else None,
                o=matrix(f"layers.{i}.o", [(p + "self_attn.o_proj.weight", (hidden, q_size))]),
                post_norm=take(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up=matrix(
                    f"layers.{i}.gate_up",
                    [
                        (p + "mlp.gate_proj.weight", (inter, hidden)),
                        (p + "mlp.up_proj.weight", (inter, hidden)),
                    ],
                ),
                down=matrix(f"layers.{i}.down", [(p + "mlp.down_proj.weight", (hidden, inter))]),
            )
        )
    embed_shape = (cfg.vocab_size, hidden)
    embed = take("model.embed_tokens.weight", embed_shape)
    if quantized is not None:
        lm_head = matrix("lm_head", [])
    elif cfg.tie_word_embeddings or "lm_head.weight" not in raw:
        if not cfg.tie_word_embeddings:
            raise CheckpointError(f"{model_dir}: tensor 'lm_head.weight' is missing")
        lm_head = (
            take("model.embed_tokens.weight", embed_shape, linear=True) if as_stored else embed
        )
    else:
        lm_head = take("lm_head.weight", embed_shape, linear=True)
    return ModelWeights(
        embed=embed, layers=layers, norm=take("model.norm.weight", (hidden,)), lm_head=lm_head
    )
