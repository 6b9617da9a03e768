"""A worker slowed by a CPU hog pinned to its own core is slow, not stalled: under
`switchyard serve` it stays `ready` throughout, and the capacity model the gateway admits
by (`/admin/fleet` `capacity`) follows it: the worker's measured step grows, and so does
the first-token time the gateway predicts for a typical request (medians of five
readings: one reading of a live engine is noisy)."""

import statistics
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

import httpx
import pytest

from tests.support.serve_stack import ENGINE, serve, wait_for

pytestmark = pytest.mark.timeout(150)

HOG = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def test_a_slowed_worker_stays_ready_and_the_capacity_estimate_drops(
    tmp_path: Path, demo_dir: Path
) -> None:
    pool = {
        "model_dir": str(demo_dir),
        "engine": ENGINE,
        "min_replicas": 1,
        "max_replicas": 1,
        "cores_per_rank": 1,
        "ttft_target_s": 5.0,
        "itl_target_s": 0.5,
    }
    config = {"pools": {"small": pool}, "cascade": {"enabled": False}}
    with serve(tmp_path, config) as stack:
        env = stack.exports()
        base, key = env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]
        (replica,) = stack.replicas("small")
        (core,) = replica["devices"]
        stop, states = threading.Event(), set()

        def traffic() -> None:  # keeps the engine stepping, 4 streams at a time
            body = {"model": "small", "prompt": "Once upon a time", "max_tokens": 64}
            with httpx.Client(headers={"authorization": f"Bearer {key}"}, timeout=60) as c:
                while not stop.is_set():
                    c.post(f"{base}/completions", json=body)

        def capacity() -> dict:
            cap = stack.admin("/admin/fleet")["small"]["capacity"]
            states.update(r["state"] for r in stack.replicas("small"))
            return cap

        def worker(field: str) -> float | None:
            workers = capacity()["workers"]
            return workers[0][field] if workers else None

        def ttft() -> float | None:
            return capacity()["predicted_ttft_s"]

        def rises(read, floor: float, what: str) -> float:  # noqa: ANN001
            """Waits until the median of the last five readings of `read` is >= `floor`
            (a single reading of a live engine is noisy); returns that median."""
            recent: deque[float] = deque(maxlen=5)

            def high() -> float | None:
                if (value := read()) is not None:
                    recent.append(value)
                m = statistics.median(recent) if len(recent) == 5 else None
                return m if m is not None and m >= floor else None

            try:
                return wait_for(high, 60, what)
            except AssertionError as exc:
                readings = f"last readings {list(recent)}, floor {floor}"
                raise AssertionError(f"{exc}: {readings}") from None

        clients = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
        for t in clients:
            t.start()
        hogs: list[subprocess.Popen] = []
        try:
            # Measured step and the predicted TTFT of a typical request, before the hogs.
            before_step = rises(lambda: worker("step_s"), 0.0, "the worker's measured step")
            before_ttft = rises(ttft, 0.0, "a predicted TTFT")
            # Each hog in a session of its own: with the kernel's autogroups (one per
            # session, as the worker's own), hogs sharing one session would take only half
            # of the core between them; three sessions take three quarters.
            hogs = [
                subprocess.Popen([sys.executable, "-c", HOG, str(core)], start_new_session=True)
                for _ in range(3)
            ]
            rises(lambda: worker("step_s"), 1.5 * before_step, "the measured step to grow")
            rises(ttft, 1.3 * before_ttft, "the predicted TTFT to grow")
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
            stop.set()
        for t in clients:
            t.join(60)
        assert states == {"ready"}, states  # never stalled, never restarted
        assert stack.replicas("small")[0]["restarts"] == 0
        assert "stalled" not in stack.err
