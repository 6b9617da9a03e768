"""`switchyard serve` end to end, as a subprocess on the tiny demo checkpoint: it comes up,
answers its own printed `curl` with `model: auto`, autoscales a pool up under a burst and
back down when quiet without failing a request, restarts a killed worker (its in-flight
streams end in-band), and leaves no process behind after Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.serve_stack import all_gone, pool_config, serve, wait_for

pytestmark = pytest.mark.timeout(90)


def test_serve_comes_up_answers_the_printed_curl_with_auto_and_ctrl_c_leaves_no_process(
    tmp_path: Path, demo_dir: Path
) -> None:
    config = {
        "pools": {"small": pool_config(demo_dir), "large": pool_config(demo_dir, max_replicas=1)},
        "cascade": {"enabled": True, "target_fraction": 0.5},
    }
    with serve(tmp_path, config) as stack:
        exports = stack.exports()
        assert exports["OPENAI_BASE_URL"] == f"{stack.url}/v1"
        assert exports["OPENAI_API_KEY"].startswith("sy-")
        curl = next(line for line in stack.out.splitlines() if line.startswith("curl "))
        done = subprocess.run(
            ["bash", "-c", curl.replace("curl -s", "curl -s -D /dev/stderr", 1)],
            env={**os.environ, **exports},
            capture_output=True,
            text=True,
            timeout=30,
        )
        body = json.loads(done.stdout)
        assert body["choices"][0]["message"]["content"]
        assert re.search(r"x-switchyard-route: (classifier|overflow)", done.stderr, re.I)
        assert "generated an admin key" in stack.err
        assert (stack.data_dir / "admin-key").stat().st_mode & 0o777 == 0o600
        # The access line: tenant, model, route, status; never the key.
        wait_for(lambda: "tenant=demo" in stack.err, 5, "the access line")
        assert exports["OPENAI_API_KEY"] not in stack.err
        children = stack.processes() + [stack.redis_server()]
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert names.count(" worker ") == 2
        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(30) == 0
        wait_for(lambda: all_gone(children), 10, "every child to exit")
        assert "Traceback" not in stack.err, stack.err[-3000:]


def _stream(base: str, key: str, results: list, max_tokens: int = 32) -> None:
    """One streaming request; appends 'ok' or what went wrong."""
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    try:
        with httpx.stream(
            "POST", f"{base}/chat/completions", json=body, headers=headers, timeout=30
        ) as r:
            if r.status_code != 200:
                results.append(f"status {r.status_code}")
                return
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        results.append(repr(exc))
        return
    if events[-1] != "data: [DONE]" or any("error" in json.loads(e[6:]) for e in events[:-1]):
        results.append(f"cut: {events[-2:]}")
    else:
        results.append("ok")


def test_a_burst_scales_the_pool_up_and_quiet_drains_it_back_without_failing_a_request(
    tmp_path: Path, demo_dir: Path
) -> None:
    scaler = {
        "target_running_per_replica": 1,
        "up_tolerance": 0.0,
        "backlog_drain_s": 5,
        "scale_up_window_s": 1,
        "scale_down_window_s": 3,
    }
    config = {
        "pools": {
            "small": pool_config(demo_dir, min_replicas=1, max_replicas=2, autoscaler=scaler)
        },
        "cascade": {"enabled": False},
        "fleet": {"interval_s": 0.5, "rate_window_s": 3},
    }
    with serve(tmp_path, config) as stack:
        env = stack.exports()
        base, key = env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]
        results: list[str] = []
        stop = threading.Event()
        level = {"clients": 4}

        def client(i: int) -> None:
            while not stop.is_set():
                if i < level["clients"]:
                    # Long streams: a client is running on a replica nearly all the
                    # time, however fast the engine gets through a request.
                    _stream(base, key, results, max_tokens=256)
                else:
                    time.sleep(0.05)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(stack.replicas("small")) >= 2, 30, "a second replica ordered")
            # Enough load to keep the order (demand of 2 slots), less CPU for it to start.
            level["clients"] = 2
            wait_for(
                lambda: sum(r["state"] == "ready" for r in stack.replicas("small")) >= 2,
                30,
                "a second ready replica",
            )
            fleet = stack.admin("/admin/fleet")["small"]
            assert "scale up" in json.dumps(fleet) or fleet["decision"]
            level["clients"] = 1  # quiet: one client keeps streaming through the drain
            wait_for(lambda: len(stack.replicas("small")) == 1, 30, "the pool back at one replica")
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(35)
        assert results and set(results) == {"ok"}, [r for r in results if r != "ok"][:5]
        assert "draining small-" in stack.err
        # One access line per request, streams included (logged when they settle).
        assert re.search(r"tenant=demo model=small route=\w+ status=200 tokens=\d+", stack.err)
        assert "Logging error" not in stack.err


def test_a_killed_worker_is_restarted_its_streams_end_in_band_and_sigterm_stops_all(
    tmp_path: Path, demo_dir: Path
) -> None:
    config = {
        "pools": {"small": pool_config(demo_dir, min_replicas=1, max_replicas=1)},
        "cascade": {"enabled": False},
        "fleet": {"autoscale": False, "interval_s": 0.5},
    }
    with serve(tmp_path, config) as stack:
        env = stack.exports()
        base, key = env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]
        (replica,) = stack.replicas("small")
        body = {
            "model": "small",
            "prompt": "Once upon a time",
            "max_tokens": 1500,
            "min_tokens": 1500,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {key}"}
        outcomes: list[str] = []
        with httpx.Client(timeout=20) as http:
            streams = [
                http.stream("POST", f"{base}/completions", json=body, headers=headers)
                for _ in range(2)
            ]
            responses = [s.__enter__() for s in streams]
            lines = [r.iter_lines() for r in responses]
            for it in lines:  # each stream has its first token: in flight on the worker
                assert next(line for line in it if line.startswith("data: {"))
            os.kill(replica["pid"], signal.SIGKILL)
            t0 = time.monotonic()
            for it in lines:
                rest = [line for line in it if line.startswith("data: ")]
                outcomes.append(rest[-2] if len(rest) > 1 else "")
                assert rest[-1] == "data: [DONE]"
            assert time.monotonic() - t0 < 15
            for s in streams:
                s.__exit__(None, None, None)
        assert all(o and "error" in json.loads(o[6:]) for o in outcomes), outcomes
        wait_for(
            lambda: any(
                r["state"] == "ready" and r["restarts"] >= 1 for r in stack.replicas("small")
            ),
            40,
            "the worker restarted and ready",
        )
        # Back in the rotation: a new request is served.
        wait_for(
            lambda: (
                httpx.post(
                    f"{base}/completions",
                    json={"model": "small", "prompt": "Hi", "max_tokens": 4},
                    headers=headers,
                    timeout=10,
                ).status_code
                == 200
            ),
            10,
            "a request served after the restart",
        )
        assert "exited with status -9" in stack.err
        # SIGTERM stops everything too, children and the daemonized redis-server included.
        children = stack.processes() + [stack.redis_server()]
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(30) == 0
        wait_for(lambda: all_gone(children), 10, "every child to exit")
        assert "Traceback" not in stack.err, stack.err[-3000:]
