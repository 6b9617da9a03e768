"""The supervisor places every replica on devices of its own and starts none it cannot
place: real child processes (`sleep`), their affinity and environment read back from the
kernel."""

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.support.waiting import settles
from tests.unit.workers.test_supervisor import Clock, FakeClient, Members
from workers.fleet.devices import DeviceInventory, NoDevices, Placement, rank_slices
from workers.fleet.supervisor import LocalSupervisor, PoolLaunch, SupervisorConfig

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
CORES = sorted(os.sched_getaffinity(0))


def supervisor(tmp_path: Path, placement: Placement, devices: dict) -> LocalSupervisor:
    launch = PoolLaunch(lambda port: SLEEP, placement=placement)
    return LocalSupervisor(
        {"small": launch},
        FakeClient(),  # type: ignore[arg-type]
        Members(),
        SupervisorConfig(log_dir=tmp_path, stop_grace_s=5.0),
        clock=Clock(),
        inventory=DeviceInventory(devices),
    )


def test_each_replica_runs_on_cores_of_its_own_and_none_starts_past_them(tmp_path: Path):
    assert len(CORES) >= 2, "this test needs two cores to place two replicas"

    async def scenario() -> None:
        sup = supervisor(tmp_path, Placement("cpu", per_rank=1), {"cpu": CORES})
        ids = [sup.start_replica("small") for _ in CORES]
        placed = [os.sched_getaffinity(sup.replicas[i].proc.pid) for i in ids]
        assert placed == [{c} for c in CORES]  # one core each, all different
        assert sup.startable("small") == 0
        with pytest.raises(NoDevices, match="needs 1 cpu device"):
            sup.start_replica("small")
        assert len(sup.replicas) == len(CORES)  # nothing was launched for it
        # A cancelled replica's core is free once its process is gone, not before.
        proc = sup.replicas[ids[0]].proc
        sup.drain_replica("small", ids[0])
        await settles(lambda: proc.poll() is not None and sup.startable("small") == 1, 10**6)
        again = sup.start_replica("small")
        assert os.sched_getaffinity(sup.replicas[again].proc.pid) == {CORES[0]}
        assert sup.replicas[again].to_dict()["devices"] == [CORES[0]]
        await sup.stop()

    asyncio.run(scenario())


def test_a_gpu_replica_sees_only_its_own_devices(tmp_path: Path):
    async def scenario() -> None:
        sup = supervisor(tmp_path, Placement("cuda", per_rank=1, ranks=2), {"cuda": [3, 5, 6]})
        rid = sup.start_replica("small")
        environ = Path(f"/proc/{sup.replicas[rid].proc.pid}/environ").read_bytes()
        assert b"CUDA_VISIBLE_DEVICES=3,5\0" in environ
        assert sup.startable("small") == 0  # one GPU left, a replica needs two
        await sup.stop()

    asyncio.run(scenario())


def test_a_crashed_replica_keeps_its_devices_through_its_restart(tmp_path: Path):
    async def scenario() -> None:
        sup = supervisor(tmp_path, Placement("cpu", per_rank=1), {"cpu": CORES[:1]})
        rid = sup.start_replica("small")
        sup.replicas[rid].proc.kill()
        sup.replicas[rid].proc.wait()
        await sup.tick()  # reaped: a crash, restart after the backoff
        assert sup.replicas[rid].proc is None and sup.startable("small") == 0
        sup.clock.now += 10  # type: ignore[attr-defined]
        await sup.tick()
        assert os.sched_getaffinity(sup.replicas[rid].proc.pid) == {CORES[0]}
        await sup.stop()

    asyncio.run(scenario())


def test_the_inventory_gives_adjacent_devices_and_splits_them_over_ranks():
    inventory = DeviceInventory({"cpu": [7, 1, 2, 3, 4, 5]})
    need = Placement("cpu", per_rank=2, ranks=2)
    assert inventory.take("a", "p", need) == (1, 2, 3, 4)
    assert inventory.take("a", "p", need) == (1, 2, 3, 4)  # idempotent for its holder
    assert inventory.startable(need) == 0 and inventory.free("cpu") == (5, 7)
    assert rank_slices((1, 2, 3, 4), 2) == [(1, 2), (3, 4)]
    inventory.give_back("a")
    assert inventory.startable(need) == 1
    assert inventory.to_dict()["cpu"]["free"] == [1, 2, 3, 4, 5, 7]
