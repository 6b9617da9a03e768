"""Read a Hugging Face `config.json` into the few numbers our model code needs."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def max_context(self) -> int:
        """Longest sequence attention computes exactly (a sliding window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def attention_parity_context(self) -> int:
        """Context length at which a token's attention (QK and PV over that many keys)
        takes as many multiply-adds as its linear layers (qkv, o, gate/up, down)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        return max(1, linear // (2 * q))


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; expected a Hugging Face model dir")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
            f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"unsupported hidden_act {act!r} in {path}; expected 'silu'")
    num_heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(f"unsupported rope_type {rope_type!r} in {path}")
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if arch == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        rope_theta=rope_theta,
        rope_scaling=rope if rope_type != "default" else None,
        sliding_window=sliding,
        eos_token_ids=_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )
