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
