"""Checkpoint loading: shards, dtypes, and clear errors for what cannot be loaded."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import load_reference, make_tiny_checkpoint, reference_greedy
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.errors import CheckpointError
from workers.runner.plan import plan_num_kv_blocks

PROMPT = [11, 22, 33, 44, 55, 66, 77]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(num_kv_blocks=64, block_size=8, **kw))


def test_sharded_checkpoint_loads_through_its_index(tmp_path, llama_dir):
    model = load_reference(llama_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = list((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    out = engine(tmp_path / "sharded").generate([PROMPT], GREEDY)[0].token_ids
    assert out == reference_greedy(model, PROMPT, GREEDY.max_tokens)


def test_bfloat16_runs_and_agrees_with_fp32_on_a_peaked_model(llama_dir):
    fp32 = engine(llama_dir).generate([PROMPT], GREEDY)[0].token_ids
    e = engine(llama_dir, dtype="bfloat16")
    assert e.runner.kv_caches[0][0].dtype == torch.bfloat16
    bf16 = e.generate([PROMPT], GREEDY)[0].token_ids
    assert len(bf16) == GREEDY.max_tokens
    assert bf16[:3] == fp32[:3]


def test_unsupported_architecture_is_named(tmp_path, llama_dir):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*expected one of"):
        engine(bad)


def test_missing_weights_and_missing_config_are_named(tmp_path, llama_dir):
    with pytest.raises(CheckpointError, match="no config.json"):
        engine(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(llama_dir / "config.json", bare / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        engine(bare)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"up_proj.weight.*\(7, 64\), expected \(128, 64\)"):
        engine(bad)


def test_missing_tensor_is_named(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight.*missing"):
        engine(bad)


def test_kv_budget_is_a_fraction_of_free_memory_capped_by_what_can_be_used():
    per_token, block = 1024, 16
    assert plan_num_kv_blocks(10 * 2**20, 0.5, per_token, block, 10**9) == 320
    assert plan_num_kv_blocks(10 * 2**30, 0.5, per_token, block, 4096) == 256


def test_mistral_sliding_window_caps_the_context(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "mistral", sliding_window=64)
    e = engine(path)
    assert e.max_model_len == 64
