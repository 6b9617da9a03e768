"""A host's devices and which replica holds each: the fleet places every replica on devices
of its own, and starts none it cannot place.

A device is a CPU core (on a CPU host: a replica runs pinned to its cores, with as many
threads) or a GPU by index (CUDA_VISIBLE_DEVICES). A replica of a pool needs
`ranks x devices_per_rank` of its pool's kind; a tensor-parallel replica's ranks each get
their own slice of what the replica holds. A replica keeps its devices from its start
until it is gone: while it loads, serves, drains, and while it waits out a restart's
backoff (it comes back on the same devices).

Pure: which devices exist is the caller's to find (`supervisor.detect_devices`).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

DeviceKind = Literal["cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class Placement:
    """What one replica of a pool needs: `ranks x per_rank` devices of `kind`."""

    kind: DeviceKind
    per_rank: int = 1
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.per_rank < 1 or self.ranks < 1:
            raise ValueError(f"a replica needs at least one device per rank, got {self}")

    @property
    def count(self) -> int:
        return self.per_rank * self.ranks


class NoDevices(Exception):
    """No free devices for one more replica: it is not started."""

    def __init__(self, pool: str, need: Placement, free: int) -> None:
        super().__init__(
            f"no devices for another {pool} replica: it needs {need.count} {need.kind} "
            f"device(s), {free} free"
        )
        self.pool = pool
        self.need = need
        self.free = free


class DeviceInventory:
    """The devices of each kind and their holders (replica ids)."""

    def __init__(self, devices: dict[DeviceKind, Iterable[int]]) -> None:
        self._devices = {kind: tuple(sorted(set(ids))) for kind, ids in devices.items()}
        self._held: dict[str, tuple[DeviceKind, tuple[int, ...]]] = {}

    def total(self, kind: DeviceKind) -> int:
        return len(self._devices.get(kind, ()))

    def free(self, kind: DeviceKind) -> tuple[int, ...]:
        taken = {i for k, ids in self._held.values() if k == kind for i in ids}
        return tuple(i for i in self._devices.get(kind, ()) if i not in taken)

    def startable(self, need: Placement) -> int:
        """How many more replicas needing `need` the free devices hold."""
        return len(self.free(need.kind)) // need.count

    def take(self, holder: str, pool: str, need: Placement) -> tuple[int, ...]:
        """Devices for `holder` (the lowest free ids: a replica's cores stay adjacent), or
        NoDevices. A holder already placed keeps what it has."""
        if holder in self._held:
            return self._held[holder][1]
        free = self.free(need.kind)
        if len(free) < need.count:
            raise NoDevices(pool, need, len(free))
        ids = free[: need.count]
        self._held[holder] = (need.kind, ids)
        return ids

    def give_back(self, holder: str) -> None:
        self._held.pop(holder, None)

    def held_by(self, holder: str) -> tuple[int, ...] | None:
        held = self._held.get(holder)
        return held[1] if held is not None else None

    def to_dict(self) -> dict[str, dict[str, object]]:
        """For `GET /admin/fleet`: per kind, the devices, the free ones and the holders."""
        out: dict[str, dict[str, object]] = {}
        for kind, ids in self._devices.items():
            holders = {h: list(d) for h, (k, d) in sorted(self._held.items()) if k == kind}
            out[kind] = {"devices": list(ids), "free": list(self.free(kind)), "held": holders}
        return out


def rank_slices(devices: tuple[int, ...], ranks: int) -> list[tuple[int, ...]]:
    """A replica's devices split over its ranks, in order (rank r gets the r-th slice)."""
    if ranks < 1 or len(devices) % ranks:
        raise ValueError(f"{len(devices)} devices do not split over {ranks} ranks")
    k = len(devices) // ranks
    return [devices[r * k : (r + 1) * k] for r in range(ranks)]
