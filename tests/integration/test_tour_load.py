"""The tour's load (`switchyard load`: Poisson arrivals, 2 tenants, the short / long /
shared-prefix mix, `model: auto`), shorter, against `switchyard serve` with latency
targets on both pools and a batch small enough that the load presses it: nothing accepted
fails, every refusal comes before any token with Retry-After, accepted streams get their
first token within the target, and no pool ever runs more replicas than its maximum."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.serve_stack import ENGINE, serve
from tests.support.servers import REPO_ROOT

pytestmark = pytest.mark.timeout(150)

TTFT_TARGET_S = 2.0
ITL_TARGET_S = 0.2
MAX_REPLICAS = {"small": 2, "large": 1}


def _pool(model_dir: Path, max_replicas: int) -> dict:
    engine = {**ENGINE, "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 512}}
    return {
        "model_dir": str(model_dir),
        "engine": engine,
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "ttft_target_s": TTFT_TARGET_S,
        "itl_target_s": ITL_TARGET_S,
        "worker": {"max_waiting_requests": 8},
    }


def test_the_tours_load_fails_nothing_it_accepted(tmp_path: Path, demo_dir: Path) -> None:
    config = {
        "pools": {name: _pool(demo_dir, n) for name, n in MAX_REPLICAS.items()},
        "cascade": {"enabled": True, "target_fraction": 0.3},
        "fleet": {"interval_s": 0.5},
    }
    with serve(tmp_path, config) as stack:
        seen: dict[str, int] = {}
        done = threading.Event()

        def watch() -> None:  # replicas per pool, every state counted, while the load runs
            while not done.wait(0.25):
                fleet = stack.admin("/admin/fleet")
                for pool in MAX_REPLICAS:
                    seen[pool] = max(seen.get(pool, 0), len(fleet[pool]["replicas"]))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        out = tmp_path / "load.json"
        env = {**os.environ, "SWITCHYARD_CACHE": str(tmp_path / "cache")}
        cmd = [sys.executable, "-m", "cli", "load", "--url", stack.url, "--rate", "6"]
        cmd += ["--duration", "6", "--tenants", "2", "--out", str(out)]
        run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        done.set()
        watcher.join(5)
        assert run.returncode == 0, run.stderr[-3000:]
    outcomes = json.loads(out.read_text())["outcomes"]
    assert len(outcomes) >= 20
    accepted = [o for o in outcomes if o["status"] == 200]
    refused = [o for o in outcomes if o["status"] != 200]
    assert accepted
    failed = [o for o in accepted if o["error"] is not None]
    assert failed == [], failed[:3]
    for o in refused:  # before any token: a status with a Retry-After
        assert o["status"] in (429, 503) and o["retry_after_s"] is not None, o
        assert o["ttft_s"] is None
    ttfts = sorted(o["ttft_s"] for o in accepted if o["ttft_s"] is not None)
    assert ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] <= TTFT_TARGET_S, ttfts[-5:]
    assert all(seen[p] <= n for p, n in MAX_REPLICAS.items()), seen
