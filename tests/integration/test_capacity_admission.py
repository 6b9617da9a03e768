"""Admission against measured capacity, end to end with a real worker (the demo checkpoint)
behind a real gateway: a burst past what the worker can start within the TTFT target is
refused before any token, with Retry-After, while every stream it accepts gets its first
token within the target, keeps its inter-token gaps within the worker's ITL target, and
completes."""

import json
import threading
import time

import httpx
import pytest

from tests.support.gateway import gateway_in_front
from tests.support.waiting import eventually
from tests.support.worker import running_worker
from tests.support.worker_client import load

pytestmark = pytest.mark.timeout(120)

TTFT_TARGET_S = 0.6
ITL_TARGET_S = 0.25


class Stream:
    """One streaming completion through the gateway, as its client saw it."""

    def __init__(self) -> None:
        self.status = 0
        self.retry_after: str | None = None
        self.code: str | None = None
        self.ttft_s: float | None = None
        self.gaps: list[float] = []
        self.done = False
        self.error: str | None = None

    def run(self, client: httpx.Client, body: dict, go: threading.Event) -> None:
        go.wait(10)
        start = time.monotonic()
        try:
            with client.stream("POST", "/v1/completions", json=body) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    self.retry_after = r.headers.get("retry-after")
                    self.code = r.json()["error"]["code"]
                    return
                last = None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if line == "data: [DONE]":
                        self.done = True
                    elif "error" in json.loads(line[len("data: ") :]):
                        self.error = line
                    elif last is None:
                        self.ttft_s = now - start
                    else:
                        self.gaps.append(now - last)
                    last = now
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_a_burst_past_capacity_is_refused_before_any_token_and_accepted_streams_keep_their_targets(
    demo_dir,
):
    body = {"model": "small", "prompt": "Once upon a time", "max_tokens": 96, "min_tokens": 96}
    with running_worker(
        demo_dir, max_num_seqs=4, itl_target_s=ITL_TARGET_S, calibrate=True
    ) as worker:
        with gateway_in_front(
            {"small": [worker.url]},
            ttft_target_s={"small": TTFT_TARGET_S},
            load_poll_interval_s=0.05,
            door=False,
        ) as gw:
            # The worker calibrated its step times at start, as a real one does, and
            # goes on learning from real steps; the gateway learns its completion ratio.
            with gw.client() as c:
                for _ in range(3):
                    assert c.post("/v1/completions", json=body).status_code == 200
            assert eventually(lambda: load(worker.url)["decode_step_s"] is not None)
            view = gw.gateway.pools["small"].views[worker.url]
            assert eventually(lambda: view.decode_step_s is not None and view.seats)
            go, stream = threading.Event(), {**body, "stream": True}
            streams = [Stream() for _ in range(32)]
            clients = [gw.client() for _ in streams]  # made before the clock starts
            threads = [
                threading.Thread(target=s.run, args=(c, stream, go), daemon=True)
                for s, c in zip(streams, clients, strict=True)
            ]
            for t in threads:
                t.start()
            go.set()
            for t in threads:
                t.join(60)
            for c in clients:
                c.close()
            refusals = gw.gateway.pools["small"].refusals
    accepted = [s for s in streams if s.status == 200]
    refused = [s for s in streams if s.status != 200]
    assert accepted and refused, [s.status for s in streams]
    for s in refused:  # refused at once: a status, never a cut stream
        assert (s.status, s.code) == (503, "over_capacity") and s.retry_after, vars(s)
        assert int(s.retry_after) >= 1
    assert sum(refusals.values()) == len(refused)
    for s in accepted:
        assert s.done and s.error is None and len(s.gaps) == 95, vars(s)
    ttfts = [s.ttft_s for s in accepted if s.ttft_s is not None]
    assert max(ttfts) <= TTFT_TARGET_S, sorted(ttfts)
    assert p99([g for s in accepted for g in s.gaps]) <= ITL_TARGET_S
