"""Serve an ASGI app under uvicorn on a loopback port, in a background thread."""

import threading
import time
from contextlib import contextmanager

import uvicorn

from tests.support.worker import free_port


@contextmanager
def serving(app, startup_timeout_s: float = 10.0):
    """Yield the base URL of `app` served on 127.0.0.1; stop it afterwards."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    """Poll `url`/ready until it answers 200."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")


@contextmanager
def gateway_process(config: dict, workdir, port: int):
    """A `switchyard gateway` process with this config; yields its URL once ready."""
    import signal
    import subprocess
    import sys

    import yaml

    path = workdir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({"gateway": config}))
    cmd = [sys.executable, "-m", "cli.main", "gateway", "--config", str(path), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
