"""The llama-server test harness: the cached build on the default model's wheel GGUF, up on
a free port with the slots asked for, answering a greedy completion; and a server held
loading (its model a FIFO nobody writes) answering /health with 503."""

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.llama_server import (
    MODEL_NAME,
    RunningLlamaServer,
    health_status,
    running_llama_server,
)
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningLlamaServer]:
    with running_llama_server(tmp_path_factory.mktemp("llama"), num_slots=2) as s:
        yield s


def test_the_harness_server_is_healthy_with_the_slots_it_was_given(
    server: RunningLlamaServer,
) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    props = httpx.get(f"{server.base_url}/props", timeout=5).json()
    assert props["total_slots"] == 2
    slots = httpx.get(f"{server.base_url}/slots", timeout=5).json()
    assert [s["is_processing"] for s in slots] == [False, False]
    models = httpx.get(f"{server.base_url}/v1/models", timeout=5).json()
    assert MODEL_NAME in [m["id"] for m in models["data"]]
    assert server.proc.poll() is None and server.pid == server.proc.pid


def test_a_greedy_completion_is_the_same_twice_and_counts_its_tokens(
    server: RunningLlamaServer,
) -> None:
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8}
    body["temperature"] = 0
    first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()
    second = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert "Paris" in first["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 8
    assert first["choices"][0]["finish_reason"] == "length"


def test_a_server_still_loading_its_model_answers_health_503(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: none does
    with running_llama_server(tmp_path, gguf=fifo, wait=False) as loading:
        assert eventually(lambda: health_status(loading) is not None, 30)
        r = httpx.get(f"{loading.base_url}/health", timeout=5)
        assert r.status_code == 503
        assert "loading" in r.text.lower()
        assert httpx.get(f"{loading.base_url}/slots", timeout=5).status_code == 503
