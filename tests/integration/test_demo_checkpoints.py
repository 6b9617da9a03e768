"""The demo checkpoints load with plain transformers, offline, and are reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.models.demo import make_demo_checkpoints

EXPECTED_PARAMS = {"small": (1_500_000, 3_000_000), "large": (15_000_000, 25_000_000)}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_demo_checkpoints(tmp_path_factory.mktemp("demo"), show_progress=False)


def test_make_demo_checkpoints_writes_standard_hf_layout(checkpoints: dict[str, Path]) -> None:
    assert set(checkpoints) == {"small", "large"}
    for name, path in checkpoints.items():
        assert path.name == name
        for file in ("config.json", "model.safetensors", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json"):  # fmt: skip
            assert (path / file).is_file(), f"{name}: missing {file}"


@pytest.mark.parametrize("name", ["small", "large"])
def test_demo_model_loads_with_expected_size_and_token_ids(
    checkpoints: dict[str, Path], name: str
) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoints[name], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[name], local_files_only=True)

    low, high = EXPECTED_PARAMS[name]
    assert low <= model.num_parameters() <= high
    config = model.config
    assert config.model_type == "llama"
    assert config.vocab_size == len(tokenizer) == 4096
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    assert model.dtype == torch.float32
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    if name == "large":
        assert config.num_key_value_heads < config.num_attention_heads

    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 4096)
    assert torch.isfinite(logits).all()


def test_demo_tokenizer_round_trips_utf8_text(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["small"], local_files_only=True)
    text = "naïve café ✓ — def f(x):\n\treturn x  # 日本語 🚀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_demo_tokenizer_special_tokens_are_single_ids(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["small"], local_files_only=True)
    for token in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == tokenizer.pad_token == "<|end_of_text|>"


def test_demo_tokenizer_applies_chatml_template(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["large"], local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    without_prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
    )
    assert without_prompt == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_make_demo_checkpoints_is_byte_identical_across_runs(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    again = make_demo_checkpoints(tmp_path, show_progress=False)
    for name in ("small", "large"):
        for file in ("model.safetensors", "tokenizer.json"):
            first = (checkpoints[name] / file).read_bytes()
            assert first == (again[name] / file).read_bytes(), f"{name}/{file} differs"
