"""A tiny Llama GGUF made as llama.cpp's converter makes one (q/k rows permuted for its
rotary layout, linear weights in GGML block types quantized by gguf-py), and its float
checkpoint made as `workers.models.gguf_convert` makes the default model's: transformers
reads the GGUF and dequantizes it, the state dict is written with safetensors."""

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `permute` of attn_q / attn_k rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama_gguf(ckpt: Path, out: Path, block_type: Callable[[str], str]) -> Path:
    """`ckpt` (a tiny Llama checkpoint) as a GGUF file; `block_type(gguf_name)` is each 2-D
    tensor's GGML type ("Q4_1", "Q4_0", "Q8_0", "F32")."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    cfg = model.config
    rope_theta = getattr(cfg, "rope_theta", None) or (cfg.rope_parameters or {})["rope_theta"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for hf_name, tensor in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.numpy()
        role = next((r for r in heads if f".{r}." in name), None)
        if role is not None:
            data = permute_rows(data, heads[role])
        kind = block_type(name) if data.ndim == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def convert_to_checkpoint(gguf_path: Path, out: Path) -> Path:
    """The GGUF as a float32 safetensors checkpoint, as `gguf_convert` writes one (minus the
    tokenizer: the tiny GGUF has none)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    for key in ("quantization_config", "_model_name_or_path"):
        raw.pop(key, None)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out
