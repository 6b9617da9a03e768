"""Two hosts (network namespaces joined by a veth, tests/support/netns.py), one fleet:

host A: Redis, a gateway, a worker; host B: a gateway, a worker. Both workers are real
`switchyard worker --join` processes on the demo checkpoint, each listening on its own
host's address and joining pool `small` in host A's Redis; both gateways are real
`switchyard gateway` processes that take the pool's members from that Redis (no static
URL). The test process reaches them only from inside the hosts (`Host.call`).

Shown here: every gateway sees both hosts' workers and sends requests to both; a tenant's
quota holds exactly across the two gateways; a worker killed outright (SIGKILL: no
withdrawal) leaves both gateways' rotation within its TTL plus one poll, and every stream
it was serving is resumed on the other host's worker or ends with an in-band error, none
cut; with host B's processes all gone, host A serves on.
"""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from quota import keyspace
from tests.support.netns import Host, TwoHosts, require_netns, start_redis, two_hosts
from tests.support.servers import REPO_ROOT, wait_ready

ADMIN_KEY = "two-hosts-admin"
CONTROL_KEY = "two-hosts-control"
POOL = "small"
TTL_S = 2.0  # the workers' heartbeat TTL (--join-ttl)
POLL_S = 0.5  # the gateways' re-read period
GATEWAY_PORT = 8000
WORKER_PORT = 8100


@dataclass
class Fleet:
    hosts: TwoHosts
    redis_url: str
    workdir: Path
    gateways: dict[str, str] = field(default_factory=dict)  # "a"/"b" -> URL
    workers: dict[str, str] = field(default_factory=dict)  # "a"/"b" -> URL
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def host(self, name: str) -> Host:
        return self.hosts.a if name == "a" else self.hosts.b

    def rotation(self, via: str) -> dict[str, str]:
        """URL -> state of the pool's members as gateway `via` has them now."""
        return self.host(via).call(lambda: _rotation(self.gateways[via]))

    def served(self, worker: str) -> int:
        """Requests worker `worker` has finished (its own /metrics)."""
        url = self.workers[worker]
        return self.host(worker).call(lambda: _finished_requests(url))


def _rotation(gateway_url: str) -> dict[str, str]:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    fleet = httpx.get(f"{gateway_url}/admin/fleet", headers=headers, timeout=10).json()
    return {w["url"]: w["state"] for w in fleet[POOL]["workers"]}


def _finished_requests(worker_url: str) -> int:
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "switchyard_worker_request_success_total"
        )
    )


def _spawn(host: Host, argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return host.popen(
            [sys.executable, "-m", "cli.main", *argv],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _start_worker(fleet: Fleet, name: str, model_dir: Path) -> None:
    host = fleet.host(name)
    url = f"http://{host.address}:{WORKER_PORT}"
    argv = ["worker", "--model", str(model_dir), "--host", host.address]
    argv += ["--port", str(WORKER_PORT), "--control-key", CONTROL_KEY]
    argv += ["--join", fleet.redis_url, "--pool", POOL, "--host-id", f"host-{name}"]
    argv += ["--join-ttl", str(TTL_S)]
    proc = _spawn(host, argv, fleet.workdir / f"worker-{name}.log")
    fleet.procs[f"worker-{name}"] = proc
    fleet.workers[name] = url
    host.call(lambda: wait_ready(url, 180.0, proc))


def _start_gateway(fleet: Fleet, name: str) -> None:
    host = fleet.host(name)
    config = {
        "gateway": {
            "pools": {POOL: []},
            "membership": {"enabled": True, "ttl_s": TTL_S, "poll_s": POLL_S},
            "redis_url": fleet.redis_url,
            "admin_key": ADMIN_KEY,
            "default_pool": POOL,
            "data_dir": str(fleet.workdir / f"gateway-{name}"),
        }
    }
    path = fleet.workdir / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["gateway", "--config", str(path), "--host", host.address]
    argv += ["--port", str(GATEWAY_PORT)]
    proc = _spawn(host, argv, fleet.workdir / f"gateway-{name}.log")
    url = f"http://{host.address}:{GATEWAY_PORT}"
    fleet.procs[f"gateway-{name}"] = proc
    fleet.gateways[name] = url
    host.call(lambda: wait_ready(url, 180.0, proc, "/health"))


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_netns()
    workdir = tmp_path_factory.mktemp("two-hosts")
    with two_hosts() as hosts:
        made = Fleet(hosts, start_redis(hosts.a, workdir / "redis"), workdir)
        _start_worker(made, "a", demo_dir)
        _start_worker(made, "b", demo_dir)
        _start_gateway(made, "a")
        _start_gateway(made, "b")
        both = set(made.workers.values())
        for via in ("a", "b"):
            _wait_for(
                lambda via=via: {u for u, s in made.rotation(via).items() if s == "ready"} == both,
                30.0,
                f"gateway {via} has both workers ready",
            )
        yield made


def _tenant_key(fleet: Fleet, tenant_id: str, limits: dict) -> str:
    def create() -> str:
        with httpx.Client(
            base_url=fleet.gateways["a"],
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        ) as admin:
            r = admin.post("/admin/tenants", json={"tenant_id": tenant_id, "limits": limits})
            assert r.status_code == 201, r.text
            k = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "test"})
            assert k.status_code == 201, k.text
            return k.json()["key"]

    return fleet.hosts.a.call(create)


async def _completions(gateway_url: str, key: str, prompts: list[str], max_tokens: int) -> list:
    """POST one completion per prompt, all at once; (status, body) of each."""
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=60) as client:

        async def one(prompt: str) -> tuple[int, dict]:
            body = {"model": POOL, "prompt": prompt, "max_tokens": max_tokens}
            r = await client.post("/v1/completions", json=body)
            return r.status_code, r.json()

        return await asyncio.gather(*(one(p) for p in prompts))


def test_each_gateway_sends_requests_to_the_workers_of_both_hosts(fleet: Fleet) -> None:
    key = _tenant_key(fleet, "spread", {})
    for via in ("a", "b"):
        before = {w: fleet.served(w) for w in ("a", "b")}
        gateway = fleet.gateways[via]
        for batch in range(10):  # until both have served some; load-aware, so spread fast
            prompts = [f"{via} batch {batch} prompt {i}: count slowly" for i in range(8)]
            results = fleet.host(via).call(
                lambda p=prompts, g=gateway: asyncio.run(_completions(g, key, p, 24))
            )
            assert [s for s, _ in results] == [200] * len(prompts), results
            if all(fleet.served(w) > before[w] for w in ("a", "b")):
                break
        else:
            pytest.fail(f"gateway {via} never sent to both hosts' workers")


def test_a_quota_holds_exactly_across_both_gateways(fleet: Fleet) -> None:
    limit = 6
    key = _tenant_key(fleet, "quota", {"requests_per_minute": limit})
    results: dict[str, list] = {}

    def burst(via: str) -> None:
        prompts = [f"quota {via} {i}" for i in range(8)]
        gateway = fleet.gateways[via]
        results[via] = fleet.host(via).call(
            lambda: asyncio.run(_completions(gateway, key, prompts, 2))
        )

    threads = [threading.Thread(target=burst, args=(via,)) for via in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = [s for via in ("a", "b") for s, _ in results[via]]
    assert set(statuses) <= {200, 429}, results
    served = [body for via in ("a", "b") for s, body in results[via] if s == 200]

    def windows_and_tokens() -> tuple[list[int], int]:
        with redis.Redis.from_url(fleet.redis_url) as client:
            prefix = keyspace.tenant_prefix("quota")
            rpm = [int(v) for v in client.mget(list(client.scan_iter(match=prefix + "rpm:*")))]
            tpm_keys = list(client.scan_iter(match=prefix + "tpm:*"))
            return rpm, sum(int(v or 0) for v in client.mget(tpm_keys))

    windows, _ = fleet.hosts.b.call(windows_and_tokens)
    # Every admitted request counted once, in one minute window, by whichever gateway.
    assert sum(windows) == len(served)
    assert all(w <= limit for w in windows), windows  # never past the limit
    if len(windows) == 1:  # the burst fell in one minute (it nearly always does): exact
        assert len(served) == limit and statuses.count(429) == 16 - limit
    # Tokens charged come to exactly what the served answers used, whichever gateway
    # served them (each reconciles its reservations after answering: wait for that).
    used = sum(body["usage"]["total_tokens"] for body in served)
    _wait_for(
        lambda: fleet.hosts.b.call(windows_and_tokens)[1] == used,
        15.0,
        f"{used} tokens charged",
    )


def _stream(gateway_url: str, key: str, prompt: str, max_tokens: int, started) -> dict:  # noqa: ANN001
    """One streamed completion to its end: the tokens its usage counts, its finish reason,
    and whether it ended with an in-band error or without [DONE]."""
    body = {"model": POOL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    out: dict = {"tokens": None, "finish": None, "error": None, "done": False}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=120, headers=headers) as client:
        with client.stream("POST", f"{gateway_url}/v1/completions", json=body) as answer:
            assert answer.status_code == 200, answer.read()
            for line in answer.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                for choice in chunk.get("choices", []):
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                started.set()
    return out


def test_a_killed_host_leaves_every_rotation_within_ttl_and_poll_losing_no_stream(
    fleet: Fleet,
) -> None:
    """Last in this module: it kills host B's processes."""
    key = _tenant_key(fleet, "streams", {})
    max_tokens = 400
    outcomes: list[dict] = []
    threads = []
    b_worker = fleet.workers["b"]

    def b_holds_a_stream() -> bool:
        load = fleet.hosts.b.call(lambda: httpx.get(f"{b_worker}/load", timeout=5).json())
        return load["num_running"] > 0

    def open_stream(via: str, i: int) -> None:
        started = threading.Event()
        gateway = fleet.gateways[via]

        def run() -> None:
            try:
                outcomes.append(
                    fleet.host(via).call(
                        lambda: _stream(gateway, key, f"stream {via} {i}", max_tokens, started)
                    )
                )
            except BaseException as exc:  # the assertion below names it
                outcomes.append({"exception": repr(exc)})
                started.set()

        thread = threading.Thread(target=run)
        thread.start()
        threads.append(thread)
        assert started.wait(60), "a stream never started"

    for i in range(6):  # through both gateways, until host B's worker holds one
        open_stream("ab"[i % 2], i)
        if i >= 1 and b_holds_a_stream():
            break
    assert b_holds_a_stream(), "host B's worker never held a stream"

    killed_at = time.monotonic()
    fleet.procs["worker-b"].send_signal(signal.SIGKILL)  # no withdrawal: it vanishes
    left_at = {}
    for via in ("a", "b"):
        _wait_for(
            lambda via=via: b_worker not in fleet.rotation(via), 30.0, f"{b_worker} left {via}"
        )
        left_at[via] = time.monotonic() - killed_at
    print(f"worker death to removal: {left_at} s (TTL {TTL_S} + poll {POLL_S})")
    # Its record's deadline is at most TTL after its last heartbeat, and each gateway reads
    # at least every poll; the rest is this test's own polling and a loaded machine.
    for via, seconds in left_at.items():
        assert seconds <= TTL_S + POLL_S + 1.0, (via, seconds)

    for thread in threads:
        thread.join(180)
    assert outcomes and all("exception" not in o for o in outcomes), outcomes
    errors = sum(o["error"] is not None for o in outcomes)
    print(f"streams: {len(outcomes)}, whole: {len(outcomes) - errors}, in-band errors: {errors}")
    for outcome in outcomes:
        if outcome["error"] is not None:  # ended in-band: the client was told
            continue
        # Else resumed on host A's worker (or never on B's): whole, to its end (the
        # gateway sends no ignore_eos: an answer may stop), its usage counting it once.
        assert outcome["done"], f"a stream was cut without [DONE] or an error: {outcome}"
        assert outcome["finish"] in ("stop", "length"), outcome
        assert 0 < outcome["tokens"] <= max_tokens, outcome
        assert outcome["finish"] == "stop" or outcome["tokens"] == max_tokens, outcome

    # Host B's gateway goes too; host A serves on with its own worker.
    fleet.hosts.b.stop_all()
    assert fleet.hosts.b.pids() == []
    results = fleet.hosts.a.call(
        lambda: asyncio.run(_completions(fleet.gateways["a"], key, ["after host B"], 4))
    )
    assert [s for s, _ in results] == [200], results
