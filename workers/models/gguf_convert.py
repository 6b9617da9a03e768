"""GGUF file -> Hugging Face safetensors directory (config, weights, tokenizer, generation).

transformers reads a GGUF and dequantizes it to float exactly, but refuses to save a model
loaded that way, so the state dict is written with safetensors directly. Needs the
`convert` extras (`gguf`, `accelerate`). Deterministic for a given transformers version.
"""

import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path

from workers.errors import ModelFetchError

log = logging.getLogger(__name__)


def convert_gguf(
    gguf_path: Path, out_dir: Path, dtype: str, on_stage: Callable[[str], None]
) -> None:
    """Write `out_dir` so that `LLMEngine.from_pretrained(out_dir)` and transformers load it."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelFetchError(
            f"converting a GGUF needs {missing}, dependencies of switchyard: reinstall it "
            "(pip install -e .)"
        )
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our stage bar stands for the whole conversion
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        on_stage("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        on_stage("weights")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    except ModelFetchError:
        raise
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelFetchError(f"cannot read {gguf_path} as a GGUF model: {exc}") from exc
    finally:
        hf_logging.enable_progress_bar()
    on_stage("save")
    config = model.config
    tied = bool(config.tie_word_embeddings)
    target = getattr(torch, dtype)
    state = {
        k: v.detach().to(target).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")  # safetensors stores no shared tensors
    }
    weights = out_dir / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)
    config.architectures = [type(model).__name__]  # a GGUF-loaded config has none
    config.dtype = dtype
    config.save_pretrained(out_dir)
    # The saved weights are plain floats: drop what would send loaders back to the GGUF.
    path = out_dir / "config.json"
    raw = json.loads(path.read_text())
    for key in ("quantization_config", "_model_name_or_path"):
        raw.pop(key, None)
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("converted %s: %d tensors, %s", gguf_path, len(state), dtype)
