"""No single request can harm anyone else: the worker over real HTTP on loopback.

Bad values are refused before the engine; a request that still makes the engine fail
fails alone while its batch goes on; a failure no request explains stops the engine,
fails what is in flight, turns /ready to 503 and asks the process to exit; control
endpoints need the control key.
"""

import json
import threading

import httpx
import pytest

from tests.support.waiting import eventually
from tests.support.worker import running_worker
from tests.support.worker_client import load
from workers.api.validation import RequestLimits

PROMPTS = ["The history of", "import os and sys", "A long time ago in"]


def body(**kw) -> dict:
    return {
        "model": "small",
        "prompt": "The history of",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }


class Call(threading.Thread):
    """One request in a thread: the SSE data events of a stream, or the response."""

    def __init__(self, url: str, payload: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.first_event = threading.Event()
        self.events: list[str] = []
        self.response: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        url = f"{self.url}/v1/completions"
        if not self.payload.get("stream"):
            self.response = httpx.post(url, json=self.payload, timeout=60)
            return
        with httpx.stream("POST", url, json=self.payload, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])
                    self.first_event.set()

    def text(self) -> str:
        self.join(60)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(e) for e in self.events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))

    def stream_error(self) -> dict:
        self.join(60)
        assert self.events[-1] == "[DONE]"
        return json.loads(self.events[-2])["error"]


class Gate:
    """Wraps the runner: holds the engine thread inside one step once `when(batch)` holds,
    and raises for any batch holding a request for which `poisoned(request)` holds."""

    def __init__(self, runner, when, poisoned=lambda req: False) -> None:
        self.runner, self.original = runner, runner.execute
        self.when, self.poisoned = when, poisoned
        self.held, self.release = threading.Event(), threading.Event()
        runner.execute = self

    def __call__(self, batch, tables):
        if not self.held.is_set() and self.when(batch):
            self.held.set()
            self.release.wait(30)
        if any(self.poisoned(r) for r, _ in batch):
            raise RuntimeError("injected failure for this request")
        return self.original(batch, tables)

    def remove(self) -> None:
        self.release.set()
        self.runner.execute = self.original


def start_together(url: str, runner, payloads: list[dict]) -> list[Call]:
    """Start requests so that the engine admits them in one step: a blocker request holds
    the engine until all of them wait."""
    gate = Gate(runner, when=lambda batch: True)
    blocker = Call(url, body(prompt="hold on", max_tokens=1))
    try:
        assert gate.held.wait(30)
        calls = [Call(url, p) for p in payloads]
        assert eventually(lambda: load(url)["num_waiting"] == len(payloads))
    finally:
        gate.remove()
    blocker.join(30)
    return calls


def test_a_request_failing_mid_batch_fails_alone_and_the_worker_stays_ready(demo_dir):
    with running_worker(demo_dir) as w:
        goods = [body(prompt=p, max_tokens=40, stream=True) for p in PROMPTS]
        reference = [c.text() for c in start_together(w.url, w.engine.runner, goods)]
        poison_ids = w.engine.tokenizer.encode("a poisoned prompt")
        good_ids = [w.engine.tokenizer.encode(p) for p in PROMPTS]

        def all_goods_mid_generation(batch) -> bool:
            mid = [r for r, _ in batch if r.prompt_token_ids in good_ids]
            return len(mid) == 3 and all(r.num_output_tokens >= 3 for r in mid)

        gate = Gate(
            w.engine.runner,
            all_goods_mid_generation,
            poisoned=lambda r: r.prompt_token_ids == poison_ids,
        )
        try:
            calls = start_together(w.url, w.engine.runner, goods)
            assert gate.held.wait(30)  # three streams mid-generation, the engine held
            bad_stream = Call(w.url, body(prompt="a poisoned prompt", stream=True))
            bad_whole = Call(w.url, body(prompt="a poisoned prompt"))
            assert eventually(lambda: load(w.url)["num_waiting"] == 2)
            gate.release.set()  # next step: three decodes and two poisoned prefills
            texts = [c.text() for c in calls]
            bad_whole.join(60)
        finally:
            gate.remove()
        assert texts == reference
        err = bad_stream.stream_error()
        assert err["code"] == "request_failed" and "injected failure" in err["message"]
        assert bad_whole.response.status_code == 500
        assert bad_whole.response.json()["error"]["code"] == "request_failed"
        assert eventually(lambda: load(w.url)["kv_blocks_used"] == 0)
        assert load(w.url)["state"] == "ready"
        assert httpx.get(f"{w.url}/ready").status_code == 200
        again = httpx.post(f"{w.url}/v1/completions", json=goods[0] | {"stream": False})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference[0]
        metrics = httpx.get(f"{w.url}/metrics").text
        assert 'switchyard_worker_request_errors_total{model_name="small"} 2.0' in metrics


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


VOCAB = 4096  # the demo checkpoints' vocabulary
BAD_COMPLETIONS = [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 10**9}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [2**70], "min_tokens": 2}, "stop_token_ids"),
    ({"prompt": [1, 2, VOCAB]}, "prompt"),
    ({"prompt": [-3]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["y" * 257]}, "stop"),
    ({"n": 17}, "n"),
    ({"priority": 2**40}, "priority"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"cache_salt": "s" * 1000}, "cache_salt"),
    ({"max_tokens": 10**12}, "max_tokens"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS)
def test_out_of_range_values_get_a_400_and_never_reach_the_engine(worker, patch, param):
    added = []
    original = worker.engine.add
    worker.engine.add = lambda req: added.append(req) or original(req)
    try:
        r = httpx.post(f"{worker.url}/v1/completions", json=body(**patch), timeout=30)
    finally:
        worker.engine.add = original
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert added == []
    assert load(worker.url)["state"] == "ready"


BAD_CHATS = [
    ({"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
    ),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"seed": 2**65}, "seed"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHATS)
def test_bad_chat_requests_get_a_400_naming_the_parameter(worker, patch, param):
    chat = {"model": "small", "messages": [{"role": "user", "content": "hi"}], **patch}
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_full_64_bit_seed_range_is_served(worker):
    for seed in (2**64 - 1, -(2**63)):
        r = httpx.post(f"{worker.url}/v1/completions", json=body(seed=seed, temperature=1.0))
        assert r.status_code == 200, r.text


def test_deeply_nested_json_is_a_400_not_a_500(worker):
    deep = b'{"model": "small", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/drain"):
        r = httpx.post(
            f"{worker.url}{path}", content=deep, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "json_too_deep"
    assert load(worker.url)["state"] == "ready"


def test_bodies_over_the_bound_get_an_openai_shaped_413(demo_dir):
    with running_worker(demo_dir, limits=RequestLimits(max_body_bytes=4096)) as w:
        r = httpx.post(f"{w.url}/v1/completions", json=body(prompt="x" * 5000))
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        assert httpx.post(f"{w.url}/v1/completions", json=body()).status_code == 200


def test_an_engine_that_dies_fails_in_flight_requests_answers_503_and_asks_to_exit(demo_dir):
    with running_worker(demo_dir) as w:
        died = threading.Event()
        w.service.on_engine_failure = died.set
        gate = Gate(w.engine.runner, when=lambda batch: True, poisoned=lambda r: True)
        try:
            first = Call(w.url, body())  # held inside the engine, alone in its step
            assert gate.held.wait(30)
            others = [
                Call(w.url, body(stream=True)),
                Call(w.url, body()),
                Call(w.url, body(stream=True)),
            ]
            assert eventually(lambda: load(w.url)["num_waiting"] == 3)
            gate.release.set()  # A fails alone; then B, C, D all fail alone: the device
            assert died.wait(30)
            first.join(30)
            for c in others:
                c.join(30)
        finally:
            gate.remove()
        assert first.response.status_code == 500
        assert first.response.json()["error"]["code"] == "request_failed"
        assert others[0].stream_error()["code"] == "engine_failed"
        assert others[1].response.status_code == 503
        assert others[1].response.json()["error"]["code"] == "engine_failed"
        assert others[2].stream_error()["code"] == "engine_failed"
        assert httpx.get(f"{w.url}/ready").status_code == 503
        assert load(w.url)["state"] == "stalled"
        assert httpx.get(f"{w.url}/health").status_code == 200
        refused = httpx.post(f"{w.url}/v1/completions", json=body())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"


def test_the_control_key_guards_drain_but_not_the_read_endpoints(demo_dir):
    with running_worker(demo_dir, control_key="s3cret") as w:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = httpx.post(f"{w.url}/drain", json={}, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_control_key"
        assert load(w.url)["state"] == "ready"
        for path in ("/load", "/health", "/ready", "/metrics", "/v1/models"):
            assert httpx.get(f"{w.url}{path}").status_code == 200, path
        bad = httpx.post(
            f"{w.url}/drain", content=b"{nope", headers={"authorization": "Bearer s3cret"}
        )
        assert bad.status_code == 400
        ok = httpx.post(f"{w.url}/drain", json={}, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["state"] == "draining"


def test_the_worker_refuses_to_open_drain_to_the_network_without_a_key(
    demo_dir, capsys, monkeypatch
):
    from cli.main import main

    monkeypatch.delenv("SWITCHYARD_WORKER_CONTROL_KEY", raising=False)
    assert main(["worker", "--model", str(demo_dir), "--host", "0.0.0.0"]) == 2
    assert "control key" in capsys.readouterr().err


BROKEN_DEVICE_WORKER = """
import sys
from workers.runner.runner import ModelRunner
def broken(self, batch, tables):
    raise RuntimeError("device lost")
ModelRunner.execute = broken
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_worker_whose_engine_dies_exits_non_zero_for_its_supervisor(demo_dir, tmp_path):
    import subprocess
    import sys

    from tests.support.servers import wait_ready
    from tests.support.worker import free_port

    port = free_port()
    cmd = [sys.executable, "-c", BROKEN_DEVICE_WORKER, "worker", "--model", str(demo_dir)]
    cmd += ["--port", str(port), "--served-model-name", "small"]
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=60)
        # One request per step, each failing alone, until too many steps in a row fail.
        codes = []
        while proc.poll() is None and len(codes) < 10:
            try:
                r = httpx.post(f"{url}/v1/completions", json=body(), timeout=30)
            except httpx.TransportError:
                break
            codes.append(r.json()["error"]["code"])
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert codes[:2] == ["request_failed", "request_failed"]
    assert "engine_failed" in codes
    assert "exiting with status 1" in log.read_text()
