"""bfloat16 against transformers in bfloat16: close logits and a high top-1 agreement.

bf16 is not bit-exact against fp32, and its output can depend on batch composition
(the matmuls' reduction order changes with the batch), so exact text is not the test:
on the engine's own greedy trajectory, transformers bf16 (teacher-forced) must give the
chosen tokens nearly the same log-probability and mostly the same argmax.
"""

import pytest
import torch

from tests.integration.test_engine_correctness import make_prompts
from tests.support.cpu import runs_native_kernels
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

NUM_TOKENS = 16
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def _reference_bf16(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    """Llama with head dim 64, the shape the native bf16 prompt-attention kernel takes."""
    from tests.support.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("head64") / "llama", "llama", hidden_size=256, intermediate_size=256
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-head64"])
@pytest.mark.parametrize("workspace", [1024, 0], ids=["workspace", "block-gather"])
def test_bf16_engine_is_close_to_transformers_bf16(arch, workspace, checkpoints, head64_dir):
    path = head64_dir if arch == "llama-head64" else checkpoints[arch]
    engine = LLMEngine.from_pretrained(
        path,
        EngineConfig(
            dtype="bfloat16",
            num_kv_blocks=256,
            block_size=4,
            decode_workspace_tokens=workspace,
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=24),
        ),
    )
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    if arch == "llama-head64" and runs_native_kernels("bfloat16"):
        assert engine.runner.prefill_kernel is not None  # whole prompts take the native kernel
    if runs_native_kernels("bfloat16"):  # the linear layers run on our kernel (o: 64 rows or more)
        assert engine.runner.linear_kernel is not None
        assert not engine.runner.model.weights.layers[0].o.is_mkldnn
    prompts = make_prompts(6, seed=5, lo=10, hi=60)
    reqs = [engine.add_request(prompt_token_ids=p, params=PARAMS) for p in prompts]
    chosen: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            chosen[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    ref = _reference_bf16(path)
    agree = total = 0
    worst = 0.0
    for prompt, req in zip(prompts, reqs, strict=True):
        out = list(req.output_token_ids)
        assert len(out) == NUM_TOKENS == len(chosen[req.request_id])
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out])).logits[0].float()
        logp = logits[len(prompt) - 1 : -1].log_softmax(-1)
        ref_chosen = logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        ours = torch.tensor(chosen[req.request_id])
        worst = max(worst, (ours - ref_chosen).abs().max().item())
        agree += (logp.argmax(-1) == torch.tensor(out)).sum().item()
        total += len(out)
    assert worst < 0.15, f"chosen-token log-probs differ by up to {worst:.3f}"
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
