"""Fleet membership in Redis: the record a pool member announces, the key names, and the
rules the announcing side (workers, supervisors) and the reading side (gateways, the
autoscaler) share. Pure: no I/O; `workers.api.membership_store` does the Redis part.

Layout (every key carries the hash tag `{fleet}`, so the scripts touch one cluster slot):
    sy:{fleet}:members:<pool>   sorted set: member id -> deadline (Redis server time, ms)
    sy:{fleet}:records:<pool>   hash: member id -> the member's record (JSON)
    sy:{fleet}:model:<pool>     the pool's model fingerprint: set by the first member to
                                announce, kept alive (TTL) by the heartbeats of members
                                that match it; a member that does not match is refused
    sy:{fleet}:changed          pub/sub channel: "<pool>" whenever a member joins, changes
                                state or withdraws (readers then read that pool at once)

A member's deadline is its last heartbeat plus its TTL, on the Redis server's clock (one
clock for every host). A reader sees only members whose deadline is ahead, so a member
that stops heartbeating (SIGKILL, a lost host) is gone from every read within its TTL; a
reader that reads at least every `poll_s` drops it within TTL + poll.

Withdrawing does not delete: the record stays, `state: withdrawn`, until its deadline, so
a reader that missed the message still tells a member that left on purpose (its requests
finish) from one that vanished (requests waiting on it are lost).
"""

import os
import re
from typing import Literal
from urllib.parse import urlsplit

import msgspec

# starting: up, model loading; ready: serving; draining: finishing what it holds, takes
# nothing new; withdrawn: gone on purpose (a tombstone until its deadline).
MemberState = Literal["starting", "ready", "draining", "withdrawn"]
ROUTABLE_STATES: tuple[MemberState, ...] = ("starting", "ready")

CHANNEL = "sy:{fleet}:changed"
DEFAULT_TTL_S = 6.0
MAX_RECORD_BYTES = 8192  # a record is untrusted input to every reader: bigger is refused
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


def process_identity(host_id: str) -> str:
    """One process of the fleet (an announcer, a lease contender, a gateway): its host, pid
    and a nonce, so a restarted process with a recycled pid is another one."""
    return f"{host_id}:{os.getpid()}:{os.urandom(3).hex()}"


def members_key(pool: str) -> str:
    return f"sy:{{fleet}}:members:{pool}"


def records_key(pool: str) -> str:
    return f"sy:{{fleet}}:records:{pool}"


def model_key(pool: str) -> str:
    return f"sy:{{fleet}}:model:{pool}"


class MemberRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One pool member as it announces itself. Units in the names; None: not known yet
    (capacity before the model has loaded) or not reported by that kind of member."""

    pool: str
    member_id: str  # unique within the pool: `member_id_for(url)`
    url: str  # where gateways send its requests (an address every gateway can reach)
    model: str  # the model name it reports (its first served name)
    fingerprint: str  # the model's identity (`workers.models.fingerprint`)
    host_id: str  # the host it runs on (its hostname unless told)
    state: MemberState = "starting"
    devices: list[str] = []  # e.g. ["cuda:0"] or ["cpu:0", "cpu:1"]
    max_num_seqs: int | None = None  # requests one batch holds
    kv_tokens: int | None = None  # tokens of KV cache
    started_at: float = 0.0  # unix seconds: when the member's process started
    # Who keeps the record alive (`Announcer.announcer_id`): a gateway in the same process
    # has that member already and leaves it alone.
    announcer: str = ""


class LiveMember(msgspec.Struct, frozen=True):
    """A record as read, with its deadline (Redis server ms) still ahead of the read."""

    record: MemberRecord
    deadline_ms: int


class PoolMembers(msgspec.Struct, frozen=True):
    """One pool as read at `now_ms` (Redis server time): its model fingerprint (None: no
    member holds it) and its live members, malformed records left out."""

    pool: str
    now_ms: int
    fingerprint: str | None
    members: list[LiveMember]
    num_malformed: int = 0


def check_name(name: str, what: str = "pool") -> str:
    """`name` if it is a usable pool (or host) name: 1-64 of letters, digits, `_.:-`,
    starting with a letter or digit. Raises ValueError saying why not."""
    if not _NAME.match(name):
        raise ValueError(
            f"{what} name {name!r} must be 1-64 letters, digits or `_.:-`, "
            "starting with a letter or digit"
        )
    return name


def check_url(url: str) -> str:
    """`url` without its trailing slash if it is an http(s) URL with a host and a port
    that a gateway can reach (not 0.0.0.0 or ::). Raises ValueError saying why not."""
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"advertise URL {url!r} must be http(s)://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"advertise URL {url!r} needs a port")
    if parts.hostname in ("0.0.0.0", "::"):
        raise ValueError(
            f"advertise URL {url!r}: {parts.hostname} is where a server listens, not an "
            "address others can reach; give the host's own address"
        )
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"advertise URL {url!r} must be http(s)://HOST:PORT, no path")
    return url.rstrip("/")


def member_id_for(url: str) -> str:
    """The member id of the member at `url`: its host and port (one record per address)."""
    return urlsplit(url).netloc


def member_state(worker_state: str) -> MemberState:
    """The record state of a worker reporting `worker_state` on /load (a stalled worker
    stays a member: the gateways' own polls see it stalled and route around it)."""
    if worker_state == "loading":
        return "starting"
    if worker_state == "draining":
        return "draining"
    return "ready"


def encode_record(record: MemberRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_record(raw: bytes | str, pool: str, member_id: str) -> MemberRecord | None:
    """The record stored under (`pool`, `member_id`); None when it is too big, malformed,
    or says it is another pool's or another member's, or its URL is not usable."""
    if len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        record = msgspec.json.decode(raw, type=MemberRecord)
        check_url(record.url)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    if record.pool != pool or record.member_id != member_id:
        return None
    return record


def wanted_members(
    members: PoolMembers, pinned: str | None = None, skip_announcer: str | None = None
) -> tuple[dict[str, MemberRecord], list[MemberRecord]]:
    """(url -> record of each member to route to, records refused for their model).

    A member is routed to while `starting` or `ready`. Its fingerprint must be the pool's:
    `pinned` where the reader's config names one, else the one Redis holds for the pool.
    Members announced by `skip_announcer` (the reader's own process) are left out of both."""
    expected = pinned or members.fingerprint
    wanted: dict[str, MemberRecord] = {}
    refused: list[MemberRecord] = []
    for live in members.members:
        record = live.record
        if skip_announcer and record.announcer == skip_announcer:
            continue
        if record.state not in ROUTABLE_STATES:
            continue
        if expected is not None and record.fingerprint != expected:
            refused.append(record)
            continue
        wanted[record.url] = record
    return wanted, refused
