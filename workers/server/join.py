"""`switchyard worker --join`: the worker announces itself as a member of a pool in the
fleet's Redis (`workers.api.membership`), with its model's fingerprint, its devices and
capacity, and its state as its own /load reports it (loading: starting; ready; draining).

It announces once its HTTP server is up (gateways count it as a replica starting), flips
to `draining` the moment `/drain` is called, and withdraws before the server stops taking
connections: on a drained exit, SIGTERM or SIGINT. A worker killed outright is gone from
every gateway within the TTL plus one poll.
"""

import logging
from dataclasses import dataclass, field

import redis.asyncio

from workers.api.membership import DEFAULT_TTL_S, MemberRecord, member_id_for, member_state
from workers.api.membership_store import MembershipStore, membership_redis
from workers.fleet.announcer import Announcer, started_at
from workers.server.service import WorkerService

log = logging.getLogger(__name__)


@dataclass
class JoinConfig:
    """Where and as what a worker joins the fleet."""

    redis_url: str
    pool: str
    advertise_url: str  # how gateways reach it (checked: `membership.check_url`)
    host_id: str
    fingerprint: str  # its model's (`workers.models.fingerprint`)
    devices: list[str] = field(default_factory=list)
    max_num_seqs: int | None = None
    ttl_s: float = DEFAULT_TTL_S


class FleetJoin:
    """The worker's membership: `start` on the server's start-up, `leave` before it stops
    taking connections. `kick` (on /drain) announces the new state at once."""

    def __init__(self, config: JoinConfig, service: WorkerService) -> None:
        self.config = config
        self.service = service
        self.started_at = started_at()
        self.redis: redis.asyncio.Redis | None = None
        self.announcer: Announcer | None = None

    def describe(self) -> MemberRecord:
        cfg, service = self.config, self.service
        kv_tokens = None
        if service.engine is not None:
            kv_tokens = service.load().kv_total_tokens or None
        return MemberRecord(
            pool=cfg.pool,
            member_id=member_id_for(cfg.advertise_url),
            url=cfg.advertise_url,
            model=service.model_name,
            fingerprint=cfg.fingerprint,
            host_id=cfg.host_id,
            state=member_state(service.state),
            devices=list(cfg.devices),
            max_num_seqs=cfg.max_num_seqs,
            kv_tokens=kv_tokens,
            started_at=self.started_at,
        )

    async def start(self) -> None:
        self.redis = membership_redis(self.config.redis_url)
        self.announcer = Announcer(MembershipStore(self.redis), self.config.ttl_s)
        self.announcer.add(self.describe)
        self.announcer.start()
        log.info(
            "joining pool %s as %s (model fingerprint %s)",
            self.config.pool,
            self.config.advertise_url,
            self.config.fingerprint,
        )

    def kick(self) -> None:
        if self.announcer is not None:
            self.announcer.kick()

    async def leave(self) -> None:
        """Withdraw (at most 2 s: with Redis unreachable the record expires instead)."""
        announcer, self.announcer = self.announcer, None
        if announcer is not None:
            await announcer.close()
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None
