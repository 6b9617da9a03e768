"""Pre-quantized weights: `switchyard models fetch NAME|DIR --quantize int8|q4` writes the
linear weights quantized beside a checkpoint (`workers.runner.prequantize`,
`workers.runner.quant_files`), and the runner reads them instead of quantizing at load.

- A q4 copy of a GGUF's float checkpoint takes its Q4_1 and Q4_0 blocks as they are, rows
  in the checkpoint's order (llama.cpp's q/k permutation undone): Q4_1 blocks are bit for
  bit what quantizing the checkpoint's floats makes, Q4_0 blocks hold those floats exactly,
  and tensors of other types (Q8_0) are quantized from the floats.
- An engine loaded from the files computes what the engine quantizing at load computes:
  the same greedy tokens and log-probabilities, in fp32 and bf16, int8 and q4.
- Files whose manifest does not match the checkpoint (it changed since, another layout)
  are not used, with a warning; a bad `--quantize` is refused by the CLI.
"""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli.main import main
from tests.integration.test_engine_correctness import make_prompts
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.tiny_gguf import convert_to_checkpoint, write_llama_gguf
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.models.fingerprint import model_fingerprint
from workers.models.model_config import load_model_config
from workers.runner import quant_files
from workers.runner.prequantize import prequantize
from workers.runner.quant import quantize

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
_FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def fused_floats(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's float linear matrices, fused and named as the runner holds them."""
    raw = load_file(ckpt / "model.safetensors")
    out = {"lm_head": raw["lm_head.weight"]}
    for i in range(load_model_config(ckpt).num_layers):
        for name, parts in _FUSED.items():
            out[f"layers.{i}.{name}"] = torch.cat(
                [raw[f"model.layers.{i}.{p}.weight"] for p in parts]
            )
    return out


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """(a tiny Llama GGUF, its float32 checkpoint): linear weights in Q4_1 blocks but layer
    0's attn_v (Q8_0) and layer 1's ffn_down (Q4_0); the output Q8_0, the embedding F32."""
    root = tmp_path_factory.mktemp("gguf")
    src = make_tiny_checkpoint(root / "src", "llama", seed=3)

    def block_type(name: str) -> str:
        if name == "token_embd.weight":
            return "F32"
        if name in ("output.weight", "blk.0.attn_v.weight"):
            return "Q8_0"
        return "Q4_0" if name == "blk.1.ffn_down.weight" else "Q4_1"

    gguf = write_llama_gguf(src, root / "tiny.gguf", block_type)
    return gguf, convert_to_checkpoint(gguf, root / "ckpt")


def test_q4_from_a_gguf_keeps_its_blocks_in_the_checkpoints_row_order(gguf_model):
    gguf, ckpt = gguf_model
    result = prequantize(ckpt, "q4", gguf, show_progress=False)
    assert result.path == ckpt.parent / "ckpt.quantized" / "q4.safetensors"
    manifest = json.loads((ckpt.parent / "ckpt.quantized" / "q4.json").read_text())
    assert manifest["tensors"] == {
        "from the GGUF's Q4_1 blocks": 12,
        "from the GGUF's Q4_0 blocks": 1,
        "quantized to q4 from the checkpoint's floats": 1,  # layer 0's v (Q8_0)
        "quantized to int8 from the checkpoint's floats": 1,  # the LM head, int8 in both
    }
    pre = quant_files.load(ckpt, "q4", load_model_config(ckpt), torch.device("cpu"))
    assert pre is not None
    floats = fused_floats(ckpt)
    assert set(pre.matrices) == set(floats)
    for name, qw in pre.matrices.items():
        w = floats[name]
        if name == "layers.1.down":  # Q4_0: its own values, which a round trip would lose
            assert torch.equal(qw.dequantize(), w)
            assert not torch.equal(quantize(w, "q4").dequantize(), w)
            continue
        ref = quantize(w, qw.kind)  # Q4_1 (q and k unpermuted), or from the floats
        assert torch.equal(qw.data, ref.data), name
        assert torch.equal(qw.scales, ref.scales), name
        assert qw.mins is None if ref.mins is None else torch.equal(qw.mins, ref.mins), name


def make_engine(path, dtype: str, quantization: str) -> LLMEngine:
    return LLMEngine.from_pretrained(
        path,
        EngineConfig(
            dtype=dtype,
            quantization=quantization,
            num_kv_blocks=128,
            block_size=4,
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=24),
        ),
    )


def greedy(engine: LLMEngine) -> list[tuple[list[int], list[tuple[float, list]]]]:
    """Each prompt's greedy tokens and, per token, its log-probability and the top 3."""
    prompts = make_prompts(4, seed=11, lo=5, hi=40)
    reqs = [engine.add_request(prompt_token_ids=p, params=PARAMS) for p in prompts]
    lps: dict[str, list] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            lps[o.request_id] += [(lp.logprob, lp.top) for lp in o.logprobs or []]
    return [(list(r.output_token_ids), lps[r.request_id]) for r in reqs]


@pytest.mark.parametrize("quantization", ["int8", "q4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_from_fetched_files_computes_what_quantizing_at_load_does(
    quantization, dtype, llama_dir, tmp_path, capsys
):
    ckpt = tmp_path / "llama"
    shutil.copytree(llama_dir, ckpt)
    at_load = make_engine(ckpt, dtype, quantization)
    assert at_load.runner.quantized_from == "quantized at load"
    expected = greedy(at_load)

    assert main(["models", "fetch", str(ckpt), "--quantize", quantization]) == 0
    out, err = capsys.readouterr()
    weights = tmp_path / "llama.quantized" / f"{quantization}.safetensors"
    assert out.strip() == str(ckpt) and str(weights) in err
    manifest = json.loads((tmp_path / "llama.quantized" / f"{quantization}.json").read_text())
    assert manifest["kind"] == quantization and manifest["layout"] == quant_files.LAYOUT
    assert manifest["checkpoint_fingerprint"] == model_fingerprint(ckpt)
    assert manifest["size_bytes"] == weights.stat().st_size
    assert weights.stat().st_mode & 0o777 == 0o644  # readable as the checkpoint is

    from_files = make_engine(ckpt, dtype, quantization)
    assert from_files.runner.quantized_from.startswith(f"read from {weights} (")
    # main() set the CLI's logging up: the load log goes to stderr
    assert f"{quantization} linear weights read from {weights}" in capsys.readouterr().err
    assert from_files.runner.weight_bytes == at_load.runner.weight_bytes
    assert from_files.runner.num_parameters == at_load.runner.num_parameters
    assert greedy(from_files) == expected


def test_files_that_do_not_match_the_checkpoint_are_not_used(llama_dir, tmp_path, caplog):
    ckpt = tmp_path / "llama"
    shutil.copytree(llama_dir, ckpt)
    prequantize(ckpt, "q4", show_progress=False)
    assert make_engine(ckpt, "float32", "q4").runner.quantized_from.startswith("read from")
    assert make_engine(ckpt, "float32", "int8").runner.quantized_from == "quantized at load"

    # the checkpoint changes (fine-tuned in place): its fingerprint with it
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] *= 1.5
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="workers.runner.quant_files"):
        engine = make_engine(ckpt, "float32", "q4")
    assert engine.runner.quantized_from == "quantized at load"
    assert "not using the pre-quantized q4 weights" in caplog.text
    assert "fetch --quantize again" in caplog.text
    held = engine.runner.model.weights.layers[0].down.dequantize()
    assert torch.equal(
        held, quantize(tensors["model.layers.0.mlp.down_proj.weight"], "q4").dequantize()
    )

    # made again, it is used again; then a manifest of another layout is not
    prequantize(ckpt, "q4", show_progress=False)
    assert make_engine(ckpt, "float32", "q4").runner.quantized_from.startswith("read from")
    manifest_path = tmp_path / "llama.quantized" / "q4.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "layout": quant_files.LAYOUT + 1}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.runner.quant_files"):
        assert make_engine(ckpt, "float32", "q4").runner.quantized_from == "quantized at load"
    assert f"layout {quant_files.LAYOUT + 1}" in caplog.text

    # the manifest matches, but the file was cut short
    manifest_path.write_text(json.dumps(manifest))
    weights = tmp_path / "llama.quantized" / "q4.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.runner.quant_files"):
        assert make_engine(ckpt, "float32", "q4").runner.quantized_from == "quantized at load"
    assert "not using the pre-quantized q4 weights" in caplog.text


def test_fetch_refuses_a_bad_quantize_and_a_directory_without_one(llama_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["models", "fetch", str(llama_dir), "--quantize", "q8"])
    assert exc.value.code == 2
    assert "argument --quantize: invalid choice: 'q8'" in capsys.readouterr().err

    ckpt = tmp_path / "llama"
    shutil.copytree(llama_dir, ckpt)
    assert main(["models", "fetch", str(ckpt)]) == 2
    assert "checkpoint directory with --quantize int8|q4" in capsys.readouterr().err
    assert main(["models", "fetch", str(tmp_path), "--quantize", "q4"]) == 2
    assert "not a checkpoint directory (no config.json)" in capsys.readouterr().err
    assert not (tmp_path / "llama.quantized").exists()


def test_a_tied_lm_head_and_qkv_biases_come_through_the_files(checkpoints, tmp_path):
    """Qwen2 (LM head tied to the embedding, q/k/v biases): int8 of the embedding is the
    file's LM head, the biases come from the checkpoint, and the engines agree."""
    ckpt = tmp_path / "qwen2"
    shutil.copytree(checkpoints["qwen2"], ckpt)
    at_load = make_engine(ckpt, "bfloat16", "q4")
    expected = greedy(at_load)
    prequantize(ckpt, "q4", show_progress=False)
    from_files = make_engine(ckpt, "bfloat16", "q4")
    assert from_files.runner.quantized_from.startswith("read from")
    float_model = make_engine(ckpt, "bfloat16", "none").runner
    assert from_files.runner.num_parameters == at_load.runner.num_parameters
    assert at_load.runner.num_parameters == float_model.num_parameters  # the head counted once
    assert greedy(from_files) == expected
