"""The supervisor with a replica kind that cannot drain itself (llama-server): stand-in
processes and a scripted probe. Draining takes it out of the rotation at once, keeps it
while something runs, and stops it after two idle polls in a row."""

import asyncio
import sys
from pathlib import Path

from workers.fleet.supervisor import LocalSupervisor, PoolLaunch, ReplicaLoad, SupervisorConfig


class ScriptedProbe:
    drains_itself = False

    def __init__(self) -> None:
        self.loads: dict[str, ReplicaLoad | None] = {}

    async def load(self, url: str) -> ReplicaLoad | None:
        return self.loads.get(url)

    async def drain(self, url: str, control_key: str | None) -> int:
        raise AssertionError("a replica that cannot drain itself is never asked to")


class Members:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool | None]] = []

    def add(self, pool: str, url: str) -> None:
        self.events.append(("add", url, None))

    def remove(self, pool: str, url: str, lost: bool) -> None:
        self.events.append(("remove", url, lost))


def make(tmp_path: Path) -> tuple[LocalSupervisor, ScriptedProbe, Members]:
    probe, members = ScriptedProbe(), Members()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup = LocalSupervisor(
        {"large": PoolLaunch(lambda port: sleep, probe=probe)},
        None,  # type: ignore[arg-type]  # the worker client is never used for this pool
        members,
        SupervisorConfig(log_dir=tmp_path, stop_grace_s=2.0),
    )
    return sup, probe, members


def test_draining_leaves_the_rotation_at_once_and_stops_after_two_idle_polls(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        sup, probe, members = make(tmp_path)
        rid = sup.start_replica("large")
        rep = sup.replicas[rid]
        probe.loads[rep.url] = ReplicaLoad("ready", num_running=1)
        await sup.tick()
        assert rep.state == "ready"
        sup.drain_replica("large", rid)
        assert members.events[-1] == ("remove", rep.url, False)
        await sup.tick()
        await sup.tick()
        assert rep.proc.poll() is None  # still running a request
        probe.loads[rep.url] = ReplicaLoad("ready", num_running=0)
        await sup.tick()
        assert rep.proc.poll() is None and not rep.terminated  # one idle poll is not enough
        await sup.tick()
        assert rep.terminated
        rep.proc.wait(5)
        await sup.tick()
        assert rid not in sup.replicas
        assert members.events.count(("remove", rep.url, False)) == 1
        await sup.stop()

    asyncio.run(scenario())


def test_a_draining_replica_that_does_not_say_what_it_runs_is_stopped_at_once(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        sup, probe, members = make(tmp_path)
        rid = sup.start_replica("large")
        rep = sup.replicas[rid]
        probe.loads[rep.url] = ReplicaLoad("ready")  # no /slots: num_running None
        await sup.tick()
        sup.drain_replica("large", rid)
        await sup.tick()
        assert rep.terminated
        await sup.stop()

    asyncio.run(scenario())
