"""A model's fingerprint (workers/models/fingerprint.py): the same model anywhere gives
the same one; another config, tokenizer, weights or serving variant gives another."""

import json
import shutil
from pathlib import Path

from workers.models.fingerprint import model_fingerprint

WEIGHTS = 5 * (1 << 20) + 123  # past the head: the sampled windows count


def make_checkpoint(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 100}))
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (root / "model.safetensors").write_bytes(bytes(i % 251 for i in range(WEIGHTS)))
    return root


def test_copies_of_one_model_share_a_fingerprint_however_the_config_is_formatted(
    tmp_path: Path,
) -> None:
    a = make_checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    written_elsewhere = {"vocab_size": 100, "hidden_size": 64, "transformers_version": "9.9",
                         "_name_or_path": "/elsewhere"}  # fmt: skip
    (b / "config.json").write_text(json.dumps(written_elsewhere, indent=2))
    (b / "README.md").write_text("not part of the model")
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a).startswith("m1-") and len(model_fingerprint(a)) == 35


def test_another_config_tokenizer_or_serving_variant_is_another_model(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    base = model_fingerprint(a)
    assert model_fingerprint(a, "quantization=int8") != base
    (a / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    assert model_fingerprint(a) != base
    c = make_checkpoint(tmp_path / "c")
    (c / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 101}))
    assert model_fingerprint(c) != base


def test_weights_changed_past_the_header_are_another_model(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    base = model_fingerprint(a)
    data = bytearray((a / "model.safetensors").read_bytes())
    # Inside the third sampled window (a fine-tune keeps the size and the header).
    span = WEIGHTS - (1 << 20)
    data[(1 << 20) + span * 2 // 16 + 10] ^= 0xFF
    (a / "model.safetensors").write_bytes(bytes(data))
    assert model_fingerprint(a) != base
