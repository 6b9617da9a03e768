"""Helper processes of the benchmarks: free ports, child processes, readiness."""

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def child_process(cmd: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Run `cmd` with its output in `log_path`; interrupt (then kill) it on exit."""
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_http(
    url: str,
    path: str = "/health",
    timeout_s: float = 120.0,
    proc: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll until `url + path` answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-2000:] if log_path else ""
            raise RuntimeError(f"{proc.args[:4]} exited: {tail}")
        time.sleep(0.1)
    raise RuntimeError(f"{url}{path} never answered")
