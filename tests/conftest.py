"""Shared fixtures: tiny random Hugging Face checkpoints written by transformers.

torch and transformers are imported inside the fixtures, so the pure-Python unit tests
run without them.
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture."""
    from tests.support.checkpoints import ARCHITECTURES, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `small` demo checkpoint (with a real trained tokenizer and chat template)."""
    from workers.checkpoints import make_demo_checkpoints

    return make_demo_checkpoints(tmp_path_factory.mktemp("demo"), show_progress=False)["small"]
