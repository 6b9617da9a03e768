"""The serve fleet's llama-server replicas, real processes: the launch `switchyard serve`
builds for a `kind: llamacpp` pool starts a supervised llama-server that turns ready on
/health, is restarted after it is killed, and is drained: out of the rotation at once,
kept running while a slot is processing, stopped once idle, the request answered whole."""

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from cli.serve.config import PoolSection, ServeConfig
from cli.serve.stack import llama_server_launches
from tests.support.llama_server import default_gguf, llama_server_binary
from workers.api.client import WorkerClient
from workers.fleet.supervisor import LocalSupervisor, SupervisorConfig


class Members:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool | None]] = []

    def add(self, pool: str, url: str) -> None:
        self.events.append(("add", url, None))

    def remove(self, pool: str, url: str, lost: bool) -> None:
        self.events.append(("remove", url, lost))


async def ticks_until(sup: LocalSupervisor, done: Callable[[], bool], timeout_s: float) -> None:
    """Tick the supervisor (as the fleet loop does) until `done()`; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        assert loop.time() < deadline, f"not true within {timeout_s} s"
        await sup.tick()
        await asyncio.sleep(0.05)


def test_a_llamacpp_replica_is_started_restarted_after_a_kill_and_drained_once_idle(
    tmp_path: Path,
) -> None:
    binary, gguf = llama_server_binary(), default_gguf()
    pool = PoolSection(kind="llamacpp", replicas=1, min_replicas=1, max_replicas=1)
    pool.llama_server.slots, pool.llama_server.ctx_per_slot = 2, 512
    pool.llama_server.extra_args = ["--no-warmup"]
    cfg = ServeConfig(pools={"large": pool}, base_dir=tmp_path)

    async def scenario() -> None:
        client, members = WorkerClient(connect_timeout_s=1.0), Members()
        launches = llama_server_launches(cfg, {"large": (binary, gguf)}, client)
        sup = LocalSupervisor(
            launches,
            client,
            members,
            SupervisorConfig(log_dir=tmp_path / "logs", restart_base_s=0.2, stop_grace_s=5),
        )
        try:
            rid = sup.start_replica("large")
            rep = sup.replicas[rid]
            assert "--metrics" in rep.proc.args and "large" in rep.proc.args  # its alias
            await ticks_until(sup, lambda: rep.state == "ready", 30)
            first_url, first_pid = rep.url, rep.proc.pid

            rep.proc.kill()
            await ticks_until(sup, lambda: rep.state == "starting", 10)
            assert ("remove", first_url, True) in members.events
            await ticks_until(sup, lambda: rep.state == "ready", 30)
            assert rep.num_restarts == 1 and rep.proc.pid != first_pid
            assert members.events[-1] == ("add", rep.url, None)

            url, proc = rep.url, rep.proc
            answer: dict = {}
            body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}
            body["ignore_eos"] = True  # all 64 tokens: a second or so on one thread

            def ask() -> None:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                answer.update(status=r.status_code, body=r.json())

            asker = threading.Thread(target=ask)
            asker.start()
            await ticks_until(sup, lambda: rep.load is not None and rep.load.num_running, 10)
            sup.drain_replica("large", rid)
            assert rep.state == "draining"
            assert members.events[-1] == ("remove", url, False)  # admission stopped at once
            for _ in range(3):
                await sup.tick()
            assert asker.is_alive(), "the request finished before the drain was watched"
            assert proc.poll() is None and not rep.terminated  # a slot is still processing
            await ticks_until(sup, lambda: rid not in sup.replicas, 30)
            asker.join(30)
            assert answer["status"] == 200
            assert answer["body"]["usage"]["completion_tokens"] == 64
            assert proc.wait(5) is not None  # stopped by the supervisor, not left running
            assert members.events.count(("remove", url, False)) == 1
        finally:
            await sup.stop()
            await client.aclose()

    asyncio.run(scenario())
