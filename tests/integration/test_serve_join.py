"""Two `switchyard serve --join` processes on two hosts (network namespaces joined by a
veth, tests/support/netns.py) sharing one real Redis on host b: one leader orders the
pool's replicas for the fleet (never more than max_replicas across both), b's gateway
serves through a's workers across the veth, every gateway exports the leader's desired
replicas, and when host a dies b takes the lease within its ttl, no request through b is
lost across the change, and b puts the pool back on its own devices."""

import ipaddress
import re
import signal
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from tests.support.netns import (
    HOST_A_ADDRESS,
    SUBNET_PREFIX_LEN,
    require_netns,
    start_redis,
    two_hosts,
)
from tests.support.serve_stack import Stack, pool_config, serve, wait_for

pytestmark = pytest.mark.timeout(300)

TTL_S = 2.0
HOSTS_NETWORK = str(ipaddress.ip_network(f"{HOST_A_ADDRESS}/{SUBNET_PREFIX_LEN}", strict=False))


def joined(url: str, host_id: str, demo_dir: Path) -> dict:
    return {
        "redis_url": url,
        "pools": {"small": pool_config(demo_dir, min_replicas=2, max_replicas=2)},
        "cascade": {"enabled": False},
        "fleet": {"join": True, "host_id": host_id, "lease_ttl_s": TTL_S},
        # /metrics answers the hosts' own network (the test reads it from inside a host).
        "gateway": {"options": {"shutdown_grace_s": 5, "metrics_networks": [HOSTS_NETWORK]}},
    }


def fleet_view(stack: Stack) -> dict:
    return stack.admin("/admin/fleet")["small"]["fleet"]


def chat(stack: Stack, key: str) -> httpx.Response:
    body = {"model": "small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return stack.call(
        lambda: httpx.post(
            f"{stack.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
    )


def desired_on_metrics(stack: Stack) -> float | None:
    text = stack.call(lambda: httpx.get(f"{stack.url}/metrics", timeout=5).text)
    found = re.search(r'^switchyard_autoscaler_desired_replicas\{pool="small"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def test_one_leader_scales_the_pool_for_two_hosts_and_a_dead_leader_is_replaced(
    tmp_path: Path, demo_dir: Path
) -> None:
    require_netns()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with two_hosts() as hosts:
        url = start_redis(hosts.b, tmp_path / "redis")  # on b: it outlives host a
        a_cm = serve(tmp_path / "a", joined(url, "a", demo_dir), 120, host=hosts.a)
        b_cm = serve(tmp_path / "b", joined(url, "b", demo_dir), 120, host=hosts.b)
        one_leader_for_both(a_cm, b_cm)


def one_leader_for_both(
    a_cm: AbstractContextManager[Stack], b_cm: AbstractContextManager[Stack]
) -> None:
    with a_cm as a:
        key = a.exports()["OPENAI_API_KEY"]  # the demo tenant, in the shared Redis
        view = fleet_view(a)
        assert view["leader"] and view["desired_replicas"] == 2
        assert len(a.replicas("small")) == 2  # the only host: both replicas placed here
        with b_cm as b:
            assert fleet_view(b)["leader"] is False
            assert b.replicas("small") == []  # the fleet had its 2: b was ordered none
            assert fleet_view(b)["hosts"] == {"a": ["small-0", "small-1"], "b": []}
            r = chat(b, key)  # through b's gateway to a's workers (membership in Redis)
            assert r.status_code == 200, r.text
            assert desired_on_metrics(a) == desired_on_metrics(b) == 2.0
            # a's replicas are announced in the membership store too (so b's gateway routes
            # to them); the leader counts them once, as a's, not again as members.
            leader_signals = a.admin("/admin/fleet")["small"]["signals"]
            assert sorted(r["replica_id"] for r in leader_signals["replicas"]) == [
                "a/small-0",
                "a/small-1",
            ]

            # Requests through b's gateway, one after another, across the change of leader:
            # each must be answered whole or refused in the API's error shape (told, with
            # Retry-After where it is a matter of capacity); none may hang, be cut or 500.
            outcomes: list[str] = []
            stop = threading.Event()

            def load() -> None:
                while not stop.is_set():
                    try:
                        r = chat(b, key)
                    except httpx.HTTPError as exc:
                        outcomes.append(f"lost: {exc!r}")
                        continue
                    if r.status_code == 200 and r.json()["choices"][0]["message"] is not None:
                        outcomes.append("served")
                    elif r.status_code in (429, 502, 503) and "error" in r.json():
                        outcomes.append(f"refused {r.status_code}")
                    else:
                        outcomes.append(f"lost: {r.status_code} {r.text[:200]}")

            loader = threading.Thread(target=load)
            loader.start()
            wait_for(lambda: "served" in outcomes, 30, "a request served before the kill")

            a.proc.send_signal(signal.SIGKILL)  # host a dies: no release, no withdrawal
            a.proc.wait(10)
            killed_at = time.monotonic()
            wait_for(lambda: fleet_view(b)["leader"], TTL_S + 10, "b to take the lease")
            took_s = time.monotonic() - killed_at
            print(f"b led {took_s:.2f} s after a's SIGKILL (ttl {TTL_S} s)")
            # Within the lease's ttl of a's last renewal, plus b's tick and admin polls.
            assert took_s <= TTL_S + 3.0, took_s

            def back_to_two() -> bool:
                replicas = b.replicas("small")
                assert len(replicas) <= 2  # max_replicas holds for the fleet
                return sum(r["state"] == "ready" for r in replicas) == 2

            wait_for(back_to_two, 120, "b's own 2 replicas ready")
            stop.set()
            loader.join(60)
            counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
            print(f"requests through b across the change of leader: {counts}")
            assert not [o for o in outcomes if o.startswith("lost")], counts
            view = fleet_view(b)
            assert view["hosts"] == {"b": ["small-0", "small-1"]}  # a's record lapsed
            assert view["orders_refused"] == 0
            assert chat(b, key).status_code == 200
            assert desired_on_metrics(b) == 2.0
