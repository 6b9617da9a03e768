"""A `switchyard serve` supervisor's local replicas, announced in the fleet's Redis so the
gateways of other hosts route to them too (`workers.api.membership`).

`AnnouncedMembership` is the supervisor's `Membership`: it tells this process's gateway
by method call, as before (`PoolMembership`), and keeps each replica announced from the
moment it starts to the moment it leaves (then withdraws it). Each heartbeat describes the
replica afresh from the supervisor: its state, its devices, its KV tokens once it reports
them. Only Switchyard pools are announced (another kind's fingerprint is not known here).
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cli.serve.config import ServeConfig
from gateway.config import GatewayConfig
from workers.api.membership import MemberRecord, MemberState, member_id_for
from workers.api.membership_store import MembershipStore, membership_redis
from workers.fleet.announcer import Announcer, default_host_id, started_at
from workers.fleet.supervisor import LocalSupervisor, Membership, Replica
from workers.models.fingerprint import model_fingerprint

log = logging.getLogger(__name__)

_STATES: dict[str, MemberState] = {
    "starting": "starting",
    "ready": "ready",
    "stalled": "ready",  # the gateways' own polls see it stalled
    "draining": "draining",
}


@dataclass
class PoolModel:
    """What every replica of one pool serves."""

    model: str  # the name its workers report (serve names them after the pool)
    fingerprint: str
    max_num_seqs: int | None = None
    device_kind: str = "cpu"  # "cpu" | "cuda": how its placed devices are named


def pool_model(name: str, model_dir: Path, engine: dict) -> PoolModel:
    """A Switchyard pool's `PoolModel` from its checkpoint and engine settings."""
    quantization = str(engine.get("quantization", "none"))
    variant = "" if quantization == "none" else f"quantization={quantization}"
    scheduler = engine.get("scheduler") or {}
    kind = "cuda" if str(engine.get("device", "cpu")).startswith("cuda") else "cpu"
    return PoolModel(
        model=name,
        fingerprint=model_fingerprint(model_dir, variant),
        max_num_seqs=scheduler.get("max_num_seqs", 128),
        device_kind=kind,
    )


@dataclass
class AnnouncedMembership:
    """`workers.fleet.supervisor.Membership` that also announces the replicas of the pools
    in `models` through `announcer`. `advertise(url)`: the URL other hosts reach a local
    replica's `url` at (identity: this host only). Set `supervisor` before the first
    replica starts (the supervisor takes this object, so it is built first)."""

    inner: Membership
    announcer: Announcer
    models: dict[str, PoolModel]
    host_id: str
    advertise: Callable[[str], str] = lambda url: url
    supervisor: LocalSupervisor | None = None
    _keys: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def add(self, pool: str, url: str) -> None:
        self.inner.add(pool, url)
        if pool not in self.models:
            return
        since = started_at()
        self._keys[(pool, url)] = self.announcer.add(lambda: self._describe(pool, url, since))

    def remove(self, pool: str, url: str, lost: bool) -> None:
        key = self._keys.pop((pool, url), None)
        if key is not None:
            self._spawn(self._withdraw(*key))
        self.inner.remove(pool, url, lost)

    def _describe(self, pool: str, url: str, since: float) -> MemberRecord:
        model = self.models[pool]
        replica = self._replica(pool, url)
        state: MemberState = "starting"
        devices: list[str] = []
        kv_tokens = None
        if replica is not None:
            state = _STATES.get(replica.state, "starting")
            devices = [f"{model.device_kind}:{d}" for d in replica.devices or ()]
            if replica.load is not None and replica.load.kv_total_tokens:
                kv_tokens = replica.load.kv_total_tokens
        advertised = self.advertise(url)
        return MemberRecord(
            pool=pool,
            member_id=member_id_for(advertised),
            url=advertised,
            model=model.model,
            fingerprint=model.fingerprint,
            host_id=self.host_id,
            state=state,
            devices=devices,
            max_num_seqs=model.max_num_seqs,
            kv_tokens=kv_tokens,
            started_at=since,
        )

    def _replica(self, pool: str, url: str) -> Replica | None:
        if self.supervisor is None:
            return None
        for replica in self.supervisor.pool_replicas(pool):
            if replica.proc is not None and replica.url == url:
                return replica
        return None

    async def _withdraw(self, pool: str, member_id: str) -> None:
        try:
            await self.announcer.withdraw(pool, member_id)
        except Exception as exc:  # noqa: BLE001 (it expires within the TTL instead)
            log.warning("pool %s: could not withdraw %s (%r)", pool, member_id, exc)

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def announced_membership(
    gateway: GatewayConfig,
    redis_url: str,
    cfg: ServeConfig,
    model_dirs: dict[str, Path],
    inner: Membership,
    host_id: str | None = None,
    advertise: Callable[[str], str] | None = None,
) -> AnnouncedMembership:
    """`inner` with the Switchyard pools' replicas announced in the fleet's Redis (the
    gateway's `membership.redis_url`, else `redis_url`) with the gateway's membership TTL.
    Start its announcer on the event loop; close it (withdraws all) before the workers."""
    redis_client = membership_redis(gateway.membership.redis_url or redis_url)
    announcer = Announcer(MembershipStore(redis_client), gateway.membership.ttl_s)
    models = {
        name: pool_model(name, path, cfg.pools[name].engine)
        for name, path in model_dirs.items()
        if cfg.pools[name].kind == "switchyard"
    }
    return AnnouncedMembership(
        inner,
        announcer,
        models,
        host_id or default_host_id(),
        advertise or (lambda url: url),
    )
