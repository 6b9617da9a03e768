"""Serve an ASGI app under uvicorn on a loopback port, in a background thread; and run the
gateway or a fake backend as a subprocess a test can signal (SIGKILL, SIGTERM, SIGSTOP)."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from tests.support.worker import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def serving(app, startup_timeout_s: float = 10.0, **config_kwargs):
    """Yield the base URL of `app` served on 127.0.0.1; stop it afterwards.

    `app` is an ASGI app (served on a free port; `config_kwargs` go to `uvicorn.Config`, e.g.
    `timeout_keep_alive=1`), or a prebuilt `uvicorn.Config` (served on its host and port, as
    `gateway.runtime.http_server.server_config` builds it)."""
    if isinstance(app, uvicorn.Config):
        if config_kwargs:
            raise TypeError("config_kwargs do not apply to a prebuilt uvicorn.Config")
        config = app
    else:
        kwargs = {"host": "127.0.0.1", "log_level": "warning", "lifespan": "on", **config_kwargs}
        kwargs.setdefault("port", free_port())
        config = uvicorn.Config(app, **kwargs)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started and time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("server exited during startup")
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("server did not start")
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(5)


def wait_ready(
    url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None, path: str = "/ready"
) -> None:
    """Poll `url` + `path` until it answers 200 (fail early if `proc` exits)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}{path}", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} never became ready")


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Stop a child we started: resume it if stopped, SIGINT, then SIGKILL past `timeout_s`."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)  # a SIGSTOPped process cannot handle SIGINT
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        proc.wait()


@contextmanager
def _child(cmd: list[str], log_path: Path | None) -> Iterator[subprocess.Popen]:
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop_process(proc)
    finally:
        if log_path is not None:
            out.close()


@contextmanager
def gateway_proc(
    config: dict,
    workdir: Path,
    port: int | None = None,
    *,
    ready_timeout_s: float = 90.0,  # a loaded CI box can take long to import torch
    wait_for: str = "/ready",
    global_args: tuple[str, ...] = (),
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `switchyard gateway` process with this config (the `gateway:` section); yields
    (URL, Popen) once `wait_for` answers 200, so the test can signal it. Its output goes to
    `workdir/gateway-<port>.log`. Stopped (SIGINT) on exit if still running. `global_args`:
    options before the command (`--log-format json`)."""
    import yaml

    port = port or free_port()
    workdir = Path(workdir)
    path = workdir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({"gateway": config}))
    cmd = [sys.executable, "-m", "cli.main", *global_args, "gateway", "--config", str(path)]
    cmd += ["--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with _child(cmd, workdir / f"gateway-{port}.log") as proc:
        wait_ready(url, ready_timeout_s, proc, wait_for)
        yield url, proc


@contextmanager
def gateway_process(config: dict, workdir, port: int):
    """A `switchyard gateway` process with this config; yields its URL once ready."""
    with gateway_proc(config, workdir, port) as (url, _):
        yield url


@contextmanager
def backend_proc(
    port: int | None = None, token_delay_s: float = 0.0, log_path: Path | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m benchmarks.fake_backend` as a subprocess (one the test can SIGSTOP);
    yields (URL, Popen) once its /health answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "benchmarks.fake_backend", "--port", str(port)]
    cmd += ["--token-delay-s", str(token_delay_s)]
    url = f"http://127.0.0.1:{port}"
    with _child(cmd, log_path) as proc:
        wait_ready(url, 30.0, proc, "/health")
        yield url, proc
