"""What hosts tell the fleet's leader, and what the leader tells hosts: wire types only.

Each host's supervisor writes a `HostRecord` to Redis about once a second with a TTL (a
host that stops writing leaves the fleet when it expires): its devices, and per pool it
runs, its replicas as its own supervisor sees them, how many more its free devices hold,
and its gateway's view of the pool's demand. The leader reads every host's record and
writes `Order`s addressed to single hosts ("start N replicas of pool P", "drain these
replicas of P"); `workers.fleet.coordination` stamps each with the leader's fencing
token and a sequence number.

Times here are relative (`age_s`) or on the Redis server's clock (`written_at_ms`):
hosts' own clocks are not comparable.
"""

import re

import msgspec

from workers.api.demand import MemberLoad
from workers.fleet.signals import ReplicaSignals, ReplicaState

_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


def check_host_id(host_id: str) -> str:
    """`host_id`, or ValueError saying what is wrong with it. It names Redis keys and
    prefixes fleet-wide replica ids (`<host id>/<replica id>`): 1-64 of letters, digits
    or `_.:-`, starting with a letter or digit (the rule membership names follow)."""
    if not _HOST_ID.match(host_id):
        raise ValueError(
            f"host id {host_id!r} must be 1-64 letters, digits or `_.:-`, "
            "starting with a letter or digit"
        )
    return host_id


class ReplicaRecord(msgspec.Struct, frozen=True):
    """One replica as its host's supervisor sees it (`ReplicaSignals`, its time relative)."""

    replica_id: str  # unique on its host
    state: ReplicaState
    age_s: float  # since it was ordered
    num_running: int | None = None
    num_waiting: int | None = None
    kv_used_tokens: int | None = None
    kv_total_tokens: int | None = None

    @classmethod
    def from_signals(cls, r: ReplicaSignals, now_s: float) -> "ReplicaRecord":
        return cls(
            r.replica_id,
            r.state,
            max(now_s - r.ordered_at_s, 0.0),
            r.num_running,
            r.num_waiting,
            r.kv_used_tokens,
            r.kv_total_tokens,
        )


class PoolRecord(msgspec.Struct, frozen=True):
    """One pool on one host: its replicas there and its gateway's demand signals."""

    replicas: list[ReplicaRecord] = []
    startable: int | None = None  # more replicas its free devices hold; None: not placed
    queue_depth: int | None = None  # requests in this host's gateway queue for the pool
    estimated_wait_s: float | None = None
    arrivals_per_s: float | None = None  # offered to this host's gateway
    mean_service_s: float | None = None
    ttft_p90_s: float | None = None
    # The load this host's gateway sees on the pool's members that joined from elsewhere
    # (URL -> load): the leader's metrics for members no supervisor polls.
    members: dict[str, MemberLoad] = {}


class DeviceCount(msgspec.Struct, frozen=True):
    total: int
    free: int


class HostRecord(msgspec.Struct, frozen=True):
    host_id: str
    devices: dict[str, DeviceCount] = {}  # per kind (cpu, cuda)
    pools: dict[str, PoolRecord] = {}  # the pools this host can run
    # The highest order sequence number this host has taken (carried out or refused):
    # the leader's orders above it are still in flight.
    last_order_seq: int = 0
    written_at_ms: int = 0  # Redis server time of the write (the store stamps it)
    # Who announces this host's replicas in the membership store (`MemberRecord.announcer`;
    # empty: they are not announced): the leader counts those members once, as this
    # host's replicas, and every other live member as a replica no supervisor runs.
    announcer: str = ""


class Order(msgspec.Struct, frozen=True):
    """One host's part of a leader's decision for one pool."""

    host_id: str
    pool: str
    num_start: int = 0
    drain: list[str] = []  # replica ids on that host
    reason: str = ""


class TakenOrder(msgspec.Struct, frozen=True):
    """An order as a host took it from Redis."""

    order: Order
    token: int  # the fencing token of the leader that wrote it
    seq: int  # fleet-wide order sequence number


def encode(value: msgspec.Struct) -> bytes:
    return msgspec.json.encode(value)


def decode_record(body: bytes, written_at_ms: int) -> HostRecord:
    """Raises msgspec.ValidationError or DecodeError on a body that is not a record."""
    record = msgspec.json.decode(body, type=HostRecord)
    return msgspec.structs.replace(record, written_at_ms=written_at_ms)


def decode_order(body: bytes) -> Order:
    return msgspec.json.decode(body, type=Order)
