"""`switchyard worker --tensor-parallel 2` (gloo, two processes) as a whole worker.

The shard group is one failure unit: a rank that is killed, or stops answering, makes
the worker answer 503 `stalled` on /ready within seconds and exit with status 1, with no
rank left behind; a model that cannot be split is refused before anything starts.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.servers import wait_ready
from tests.support.worker import free_port
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

TIMEOUTS_YAML = """
shard_group:
  collective_timeout_s: 2.0
  heartbeat_s: 0.25
"""


class Worker:
    def __init__(self, model_dir: Path, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "worker.yaml"
        config.write_text(TIMEOUTS_YAML)
        self.log = tmp_path / "worker.log"
        cmd = [sys.executable, "-m", "cli", "worker", "--model", str(model_dir)]
        cmd += ["--port", str(self.port), "--config", str(config), "--tensor-parallel", "2"]
        cmd += ["--served-model-name", "small"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))
        self.ranks: list[psutil.Process] = []
        try:
            wait_ready(self.url, timeout_s=120)
        except BaseException:  # a worker that never came up must not outlive the test
            try:
                self.ranks = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            self.stop()
            raise
        self.ranks = [
            p
            for p in psutil.Process(self.proc.pid).children()
            if "follower" in " ".join(p.cmdline())
        ]

    def stop(self) -> None:
        for p in [self.proc, *self.ranks]:
            try:
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        self.proc.wait(10)

    def stalled_within(self, timeout_s: float) -> float | None:
        """Seconds until /ready answered 503 `stalled` (None: it never did in time)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                r = httpx.get(f"{self.url}/ready", timeout=1.0)
                if r.status_code == 503 and r.json()["state"] == "stalled":
                    return time.monotonic() - t0
            except httpx.TransportError:
                return None  # gone without ever saying stalled
            time.sleep(0.05)
        return None


@pytest.fixture
def worker(demo_dir, tmp_path):
    w = Worker(demo_dir, tmp_path)
    yield w
    w.stop()


def complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    body = {"model": "small", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_sharded_worker_serves_and_a_killed_rank_makes_it_stalled_then_exit_1(worker, demo_dir):
    got = complete(worker.url, "Once upon a time")["choices"][0]["text"]
    one = LLMEngine.from_pretrained(demo_dir, EngineConfig(num_kv_blocks=64))
    assert (
        got
        == one.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0.0))[
            0
        ].text
    )
    load = httpx.get(f"{worker.url}/load").json()
    assert load["state"] == "ready" and load["kv_total_tokens"] > 0
    (rank1,) = worker.ranks
    rank1.send_signal(signal.SIGKILL)
    assert_stalled_then_exit_1(worker, rank1, within_s=2.0)


def test_a_hung_rank_makes_the_worker_stalled_within_seconds_then_exit_1(worker):
    complete(worker.url, "Hello")
    (rank1,) = worker.ranks
    rank1.send_signal(signal.SIGSTOP)  # noticed at the next heartbeat's timeout (2 s)
    assert_stalled_then_exit_1(worker, rank1, within_s=6.0)


def assert_stalled_then_exit_1(worker: Worker, rank1: psutil.Process, within_s: float) -> None:
    seconds = worker.stalled_within(10.0)
    assert seconds is not None, worker.log.read_text()[-3000:]
    assert seconds < within_s
    assert worker.proc.wait(20) == 1
    assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE
    assert "the shard group failed" in worker.log.read_text()


def test_a_model_whose_heads_do_not_divide_is_refused_before_anything_starts(llama_dir, capsys):
    from cli.main import main

    # 4 attention heads and 2 KV heads over 3 ranks.
    assert main(["worker", "--model", str(llama_dir), "--tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert "cannot shard this model over tensor_parallel=3" in err
    assert "4 attention heads" in err and "2 KV heads" in err


def test_a_drained_sharded_worker_exits_0_and_stops_its_other_ranks(worker):
    complete(worker.url, "Hello")
    (rank1,) = worker.ranks
    r = httpx.post(f"{worker.url}/drain", json={"exit_when_empty": True})
    assert r.status_code == 200, r.text
    assert worker.proc.wait(30) == 0
    rank1.wait(10)  # not our child: no status to read, but its log line says how it ended
    assert "rank 1: stopped by rank 0" in worker.log.read_text()
