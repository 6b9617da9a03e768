"""Pool members that joined through the fleet's Redis, behind two gateways: real
`switchyard worker --join` processes on the demo checkpoint, two gateways (real HTTP)
reading one real Redis.

Both gateways route to the joined workers; a worker that drains leaves both at once and
withdraws when it exits; a worker killed with SIGKILL leaves both within TTL + poll of the
kill (the measured times are printed: the issue's "time from a worker's death to its
removal on every gateway"); a member announcing another model is refused by both.
"""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis
import redis.asyncio

from benchmarks.fake_backend import FakeBackend
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig, MembershipConfig
from gateway.gateway import Gateway
from gateway.runtime.main import build_gateway
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import REPO_ROOT, serving, stop_process
from tests.support.worker import free_port
from workers.api.demand import PoolDemand, decode_demand
from workers.api.membership import MemberRecord, member_id_for
from workers.api.membership_store import MembershipStore

ADMIN = "admin-fleet-membership"
TTL_S = 3.0  # the workers' heartbeat TTL (--join-ttl): heartbeats every 1 s
POLL_S = 0.5  # the gateways' membership poll
SLACK_S = 0.5  # event-loop and process scheduling on a shared 2-core machine


@dataclass
class JoinedWorker:
    url: str
    proc: subprocess.Popen


@contextmanager
def joined_worker(
    model_dir: Path, redis_url: str, workdir: Path, name: str
) -> Iterator[JoinedWorker]:
    port = free_port()
    config = workdir / f"{name}.yaml"
    config.write_text("engine:\n  threads: 1\n  calibrate: false\n")
    cmd = [sys.executable, "-m", "cli", "worker", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--config", str(config)]
    cmd += ["--join", redis_url, "--pool", "small", "--host-id", "host-b"]
    cmd += ["--join-ttl", str(TTL_S)]
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield JoinedWorker(f"http://127.0.0.1:{port}", proc)
    finally:
        stop_process(proc)
        log.close()


@contextmanager
def gateway(redis_url: str, pools: dict[str, list[str]]) -> Iterator[tuple[str, Gateway]]:
    with tempfile.TemporaryDirectory(prefix="sy-gw-") as data_dir:
        cfg = GatewayConfig(
            pools=pools,
            data_dir=data_dir,
            admin_key=ADMIN,
            default_pool="small",
            load_poll_interval_s=0.1,
            door=False,
            membership=MembershipConfig(enabled=True, ttl_s=TTL_S, poll_s=POLL_S),
        )
        gw = build_gateway(cfg, redis_url)
        with serving(create_gateway_app(gw)) as url:
            yield url, gw


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def removal_times(gws: list[Gateway], url: str, t0: float, timeout_s: float) -> list[float]:
    """Seconds from `t0` until `url` left each gateway's pool (waiting at most `timeout_s`)."""
    left: dict[int, float] = {}
    deadline = t0 + timeout_s
    while len(left) < len(gws) and time.monotonic() < deadline:
        for i, gw in enumerate(gws):
            if i not in left and url not in gw.pools["small"].views:
                left[i] = time.monotonic() - t0
        time.sleep(0.005)
    assert len(left) == len(gws), f"{url} still in gateways {set(range(len(gws))) - set(left)}"
    return [left[i] for i in range(len(gws))]


def chat(url: str, key: str) -> httpx.Response:
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def announce(redis_url: str, record: MemberRecord, ttl_s: float) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await MembershipStore(client).announce(record, ttl_s)
        finally:
            await client.aclose()

    asyncio.run(main())


def exit_status(worker: JoinedWorker, log: Path, timeout_s: float) -> int:
    """The worker's exit status; AssertionError with its log's tail if it runs on."""
    try:
        return worker.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise AssertionError(f"{worker.url} still running:\n" + "\n".join(tail)) from None


def member_state(redis_url: str, url: str) -> str | None:
    """The state of the member at `url` in pool small as read now (None: no record)."""

    async def main() -> str | None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            read = (await MembershipStore(client).read(["small"]))["small"]
        finally:
            await client.aclose()
        return next((m.record.state for m in read.members if m.record.url == url), None)

    return asyncio.run(main())


def test_joined_workers_serve_through_two_gateways_and_leave_both_on_drain_and_on_death(
    demo_dir: Path, tmp_path: Path
) -> None:
    with start_redis() as redis_url, ExitStack() as stack:
        redis.Redis.from_url(redis_url).flushdb()
        large = FakeBackend(name="large0")
        large_url = stack.enter_context(serving(large))
        stray = FakeBackend(name="stray")  # where a member of another model would be sent
        stray_url = stack.enter_context(serving(stray))
        pools = {"small": [], "large": [large_url]}
        fronts = [stack.enter_context(gateway(redis_url, pools)) for _ in range(2)]
        gws = [gw for _, gw in fronts]
        admin = {"authorization": f"Bearer {ADMIN}"}
        r = httpx.post(f"{fronts[0][0]}/admin/tenants", json={"tenant_id": "t"}, headers=admin)
        assert r.status_code == 201, r.text
        r = httpx.post(f"{fronts[0][0]}/admin/tenants/t/keys", json={"name": "k"}, headers=admin)
        key = r.json()["key"]

        w1 = stack.enter_context(joined_worker(demo_dir, redis_url, tmp_path, "w1"))
        w2 = stack.enter_context(joined_worker(demo_dir, redis_url, tmp_path, "w2"))

        def routed(gw: Gateway) -> bool:
            views = gw.pools["small"].views
            return all(u in views and views[u].state == "ready" for u in (w1.url, w2.url))

        for i, gw in enumerate(gws):
            wait_for(lambda gw=gw: routed(gw), 240, f"both workers ready on gateway {i}")
        for url, _ in fronts:
            r = chat(url, key)
            assert r.status_code == 200, r.text
            assert r.headers["x-switchyard-model"] == "small"

        # Each gateway publishes its demand for the fleet's leader: its own report (the
        # request it took, the two workers' load as it polls them).
        r_sync = redis.Redis.from_url(redis_url)

        def reports() -> list[PoolDemand]:
            ids = r_sync.smembers("sy:{fleet}:demand_gateways")
            raw = [r_sync.hget(f"sy:{{fleet}}:demand:{i.decode()}", "small") for i in ids]
            return [d for d in (decode_demand(b) for b in raw if b) if d is not None]

        def demand_seen() -> bool:
            got = reports()
            return len(got) == 2 and all(
                (d.arrivals_per_s or 0) > 0
                and {w1.url, w2.url} <= d.members.keys()
                and all(d.members[u].num_running is not None for u in (w1.url, w2.url))
                for d in got
            )

        wait_for(demand_seen, 30, "both gateways' demand reports in Redis")
        r_sync.close()

        fleet = httpx.get(f"{fronts[1][0]}/admin/fleet", headers=admin).json()
        origins = {w["url"]: w["origin"] for p in fleet.values() for w in p["workers"]}
        assert origins == {w1.url: "joined", w2.url: "joined", large_url: "config"}
        small = fleet["small"]["membership"]
        assert small["from_redis"] and small["staleness_bound_s"] == TTL_S + POLL_S
        fingerprint = small["fingerprint"]
        assert fingerprint and fingerprint.startswith("m1-")

        # A member of another model: refused by both gateways, counted once each.
        other = MemberRecord(
            pool="small", member_id=member_id_for(stray_url), url=stray_url, model="other",
            fingerprint="m1-" + "0" * 32, host_id="host-c", state="ready",
        )  # fmt: skip
        announce(redis_url, other, ttl_s=60)
        for gw in gws:
            wait_for(
                lambda gw=gw: (
                    gw.registry.get_sample_value(
                        "switchyard_gateway_membership_refused_total", {"pool": "small"}
                    )
                    == 1
                ),
                10,
                "the other model's member refused",
            )
            assert stray_url not in gw.pools["small"].views

        # Drained: out of both rotations at once (its state is published, not waited for),
        # then withdrawn when it exits.
        t0 = time.monotonic()
        r = httpx.post(f"{w1.url}/drain", json={"exit_when_empty": True}, timeout=10)
        assert r.status_code == 200
        drained = removal_times(gws, w1.url, t0, TTL_S)
        print(f"\ndrain -> removed from the gateways' rotation: {[round(s, 3) for s in drained]} s")
        # Its tombstone lives a TTL from the withdrawal, the first step of its shutdown.
        wait_for(lambda: member_state(redis_url, w1.url) == "withdrawn", 30, "w1 withdrawn")
        assert exit_status(w1, tmp_path / "w1.log", 60) == 0
        for url, _ in fronts:  # the other worker serves both gateways alone
            assert chat(url, key).status_code == 200
        assert stray.total == 0

        # SIGKILLed: no withdrawal, so its record's deadline passes and every gateway's
        # next read drops it: within TTL + poll of the kill.
        t_kill = time.monotonic()
        os.kill(w2.proc.pid, signal.SIGKILL)
        bound = TTL_S + POLL_S
        died = removal_times(gws, w2.url, t_kill, bound + SLACK_S + 5)
        print(
            f"SIGKILL -> removed from the gateways' rotation: gateway A {died[0]:.2f} s, "
            f"gateway B {died[1]:.2f} s (TTL {TTL_S:g} s + poll {POLL_S:g} s = {bound:g} s)"
        )
        assert max(died) <= bound + SLACK_S
        # Not before its last heartbeat's deadline could have passed (at least 2/3 of the
        # TTL after the kill): it left by expiry, not by anything else.
        assert min(died) > 2 * TTL_S / 3 - SLACK_S
        for gw in gws:
            assert (
                gw.registry.get_sample_value(
                    "switchyard_gateway_membership_changes_total",
                    {"pool": "small", "change": "lost"},
                )
                == 1
            )
