"""The local supervisor with stand-in processes (`sleep`) and a scripted /load: start,
ready, crash and restart with backoff, drain and exit, cancel, stop. No torch, no HTTP."""

import asyncio
import sys
from pathlib import Path

from workers.api.types import LoadReport
from workers.fleet.supervisor import LocalSupervisor, PoolLaunch, SupervisorConfig, restart_delay_s


class FakeClient:
    """`/load` answers from a table by URL (None: unreachable); drains are recorded."""

    def __init__(self) -> None:
        self.states: dict[str, str | None] = {}
        self.drains: list[tuple[str, str | None]] = []

    async def load(self, url: str, timeout_s: float = 1.0) -> LoadReport | None:
        state = self.states.get(url)
        if state is None:
            return None
        return LoadReport(state, 1, 0, 2, 10, 128, 160, 0, 0.0, "small", 512)

    async def drain(self, url: str, *, exit_when_empty: bool = False, control_key=None) -> int:
        self.drains.append((url, control_key))
        return 200


class Members:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool | None]] = []

    def add(self, pool: str, url: str) -> None:
        self.events.append(("add", url, None))

    def remove(self, pool: str, url: str, lost: bool) -> None:
        self.events.append(("remove", url, lost))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path):  # noqa: ANN201
    client, members, clock = FakeClient(), Members(), Clock()
    launch = PoolLaunch(lambda port: [sys.executable, "-c", "import time; time.sleep(60)"])
    launch.control_key = "k"
    sup = LocalSupervisor(
        {"small": launch},
        client,  # type: ignore[arg-type]
        members,
        SupervisorConfig(log_dir=tmp_path, restart_base_s=1.0, stop_grace_s=2.0),
        clock=clock,
    )
    return sup, client, members, clock


def test_restart_backoff_doubles_up_to_the_cap() -> None:
    assert [restart_delay_s(n, 1.0, 30.0) for n in (1, 2, 3, 6, 10)] == [1, 2, 4, 30, 30]


def test_a_replica_is_starting_until_its_load_says_ready_and_joins_the_pool_at_launch(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        rid = sup.start_replica("small")
        (rep,) = sup.signals("small")
        assert rep.state == "starting" and rep.num_running is None
        url = sup.replicas[rid].url
        assert members.events == [("add", url, None)]
        client.states[url] = "loading"
        await sup.tick()
        assert sup.signals("small")[0].state == "starting"
        client.states[url] = "ready"
        await sup.tick()
        (rep,) = sup.signals("small")
        assert rep.state == "ready" and rep.kv_used_tokens == 160 - 128
        await sup.stop()

    asyncio.run(scenario())


def test_a_crashed_replica_leaves_the_pool_and_restarts_after_its_backoff(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        rid = sup.start_replica("small")
        first = sup.replicas[rid]
        client.states[first.url] = "ready"
        await sup.tick()
        old_url, old_proc = first.url, first.proc
        old_proc.kill()
        old_proc.wait()
        await sup.tick()
        assert ("remove", old_url, True) in members.events
        assert first.proc is None and sup.signals("small")[0].state == "starting"
        clock.now += 0.5
        await sup.tick()
        assert first.proc is None  # still backing off
        clock.now += 1.0
        await sup.tick()
        assert first.proc is not None and first.num_restarts == 1
        assert members.events[-1] == ("add", first.url, None)
        await sup.stop()

    asyncio.run(scenario())


def test_drain_sends_the_control_key_and_the_exit_removes_the_replica(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        rid = sup.start_replica("small")
        rep = sup.replicas[rid]
        client.states[rep.url] = "ready"
        await sup.tick()
        sup.drain_replica("small", rid)
        await asyncio.sleep(0.05)
        assert client.drains == [(rep.url, "k")]
        assert sup.signals("small")[0].state == "draining"
        rep.proc.terminate()  # the worker exits once empty
        rep.proc.wait()
        await sup.tick()
        assert sup.signals("small") == ()
        assert members.events[-1] == ("remove", rep.url, False)
        await sup.stop()

    asyncio.run(scenario())


def test_draining_a_starting_replica_cancels_it_and_stop_leaves_no_process(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        a = sup.start_replica("small")
        b = sup.start_replica("small")
        proc_a, proc_b = sup.replicas[a].proc, sup.replicas[b].proc
        sup.drain_replica("small", a)
        assert a not in sup.replicas
        await sup.stop()
        assert proc_a.wait(5) is not None and proc_b.poll() is not None

    asyncio.run(scenario())


# A worker that starts one more process, as rank 0 of a shard group starts the other ranks.
GROUP_LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""


def test_a_stalled_shard_group_is_restarted_whole_with_none_of_its_ranks_left(
    tmp_path: Path,
) -> None:
    import psutil

    pid_file = tmp_path / "rank1.pid"

    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        sup.pools["small"].argv = lambda port: [sys.executable, "-c", GROUP_LEADER, str(pid_file)]
        rid = sup.start_replica("small")
        replica = sup.replicas[rid]
        for _ in range(100):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.05)
        rank1 = int(pid_file.read_text())
        client.states[replica.url] = "ready"
        await sup.tick()
        client.states[replica.url] = "stalled"
        await sup.tick()
        clock.now += sup.config.stall_restart_s + 1
        leader = replica.proc
        await sup.tick()
        assert replica.proc is None and replica.num_crashes == 1
        leader.wait(5)
        for _ in range(100):  # the other rank got SIGKILL with its group
            try:
                if psutil.Process(rank1).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the other rank outlived its group's restart")
        await sup.stop()

    asyncio.run(scenario())


def test_a_replica_that_flaps_stays_stalled_until_it_holds_ready_and_is_then_restarted(
    tmp_path: Path,
) -> None:
    """Back from a stall it stays `stalled` (capacity already ordered, never replaced)
    until it reports ready for stall_recover_s in a row; flapping inside that keeps its
    first stall's clock, so stall_restart_s after it the replica is restarted."""

    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        rid = sup.start_replica("small")
        replica = sup.replicas[rid]
        url = replica.url
        client.states[url] = "ready"
        await sup.tick()
        client.states[url] = "stalled"
        await sup.tick()
        stalled_at = clock.now
        for _ in range(3):  # ready for less than the hold, then stalled again
            client.states[url] = "ready"
            clock.now += 1.0
            await sup.tick()
            assert replica.state == "stalled"
            assert [s.state for s in sup.signals("small")] == ["stalled"]
            client.states[url] = "stalled"
            clock.now += 1.0
            await sup.tick()
        clock.now = stalled_at + sup.config.stall_restart_s + 1
        await sup.tick()
        assert replica.proc is None and replica.num_crashes == 1  # restarted, not replaced
        assert ("remove", url, True) in members.events
        assert [s.state for s in sup.signals("small")] == ["starting"]
        await sup.stop()

    asyncio.run(scenario())


def test_a_replica_back_from_a_stall_is_ready_once_it_holds_ready(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup, client, members, clock = make(tmp_path)
        replica = sup.replicas[sup.start_replica("small")]
        client.states[replica.url] = "ready"
        await sup.tick()
        client.states[replica.url] = "stalled"
        await sup.tick()
        client.states[replica.url] = "ready"
        await sup.tick()
        assert replica.state == "stalled"
        clock.now += sup.config.stall_recover_s
        await sup.tick()
        assert replica.state == "ready" and replica.proc is not None
        assert replica.num_crashes == 0
        await sup.stop()

    asyncio.run(scenario())
