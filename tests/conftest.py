"""Shared fixtures: tiny random Hugging Face checkpoints written by transformers."""

from pathlib import Path

import pytest

from tests.support.checkpoints import ARCHITECTURES, make_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture."""
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]
