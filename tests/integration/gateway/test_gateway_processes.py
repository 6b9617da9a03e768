"""`switchyard gateway --workers N`: several gateway processes on one port (SO_REUSEPORT),
each a whole gateway over the shared Redis, supervised by one parent; and the supervisor
itself over stand-in member processes."""

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fake_backend import FakeBackend
from cli.serve.stack import check_port_free
from gateway.config import GatewayConfig
from gateway.runtime.group import MemberSpec, ProcessGroup, RestartPolicy, member_configs
from tests.integration.gateway.conftest import ADMIN
from tests.support.servers import REPO_ROOT, serving, stop_process, wait_ready
from tests.support.waiting import eventually
from tests.support.worker import free_port

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 8}
MAX_INFLIGHT = 3  # per worker, over both processes: shares [2, 1]


class PeakInFlight:
    """ASGI wrapper over a backend: the most generation requests it held at once."""

    def __init__(self, app: FakeBackend) -> None:
        self.app = app
        self.active = 0
        self.peak = 0

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
        counted = scope["type"] == "http" and scope["path"].startswith("/v1/")
        if counted:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.active -= 1


@contextmanager
def gateway_group(config: dict, workdir: Path, workers: int = 2):
    """`switchyard gateway --workers N` as a subprocess; yields (URL, Popen, log path) once
    /ready answers (on whichever member takes the connection)."""
    port = free_port()
    path = workdir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({"gateway": config}))
    cmd = [sys.executable, "-m", "cli.main", "gateway", "--config", str(path)]
    cmd += ["--port", str(port), "--workers", str(workers)]
    log = workdir / f"gateway-{port}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, 90, proc)
            yield url, proc, log
        finally:
            stop_process(proc, 30)


def members(parent: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(parent.pid).children():
        try:
            if "--member" in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def served_by_process(url: str) -> dict[str, float]:
    """Requests answered 200, per `process` label, from one scrape of /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "switchyard_gateway_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("status") == "200":
                    p = s.labels["process"]
                    counts[p] = counts.get(p, 0.0) + s.value
    return counts


def processes_in_metrics(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.labels["process"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "process" in s.labels
    }


def tenant_key(url: str, tenant: str) -> str:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        r = c.post("/admin/tenants", json={"tenant_id": tenant, "limits": {}})
        assert r.status_code == 201, r.text
        k = c.post(f"/admin/tenants/{tenant}/keys", json={"name": "test"})
        assert k.status_code == 201, k.text
        return k.json()["key"]


def complete(url: str, key: str) -> int:
    """One request on a fresh connection (so the kernel may give it to either process)."""
    r = httpx.post(
        f"{url}/v1/completions",
        json=BODY,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    return r.status_code


def _redis_servers_under(path: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline", "cwd"]):
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
        if "redis-server" in (p.info["name"] or "") + text and str(path) in text:
            found.append(p)
    return found


@pytest.mark.timeout(240)
def test_two_processes_share_one_port_the_load_and_a_worker_s_slots_then_stop_on_sigterm(
    tmp_path,
):
    data_dir = tmp_path / "data"
    backend = PeakInFlight(FakeBackend(token_delay_s=0.02, name="small0"))
    with serving(backend) as backend_url:
        cfg = {
            "pools": {"small": [backend_url]},
            "admin_key": ADMIN,
            "data_dir": str(data_dir),
            "load_poll_interval_s": 0.05,
            "max_inflight_per_worker": MAX_INFLIGHT,
        }
        with gateway_group(cfg, tmp_path) as (url, proc, log):
            children = members(proc)
            assert len(children) == 2
            redis = _redis_servers_under(data_dir)
            assert len(redis) == 1, "the parent starts the embedded Redis once, for both"
            assert eventually(lambda: processes_in_metrics(url) == {"0", "1"}, 60)
            key = tenant_key(url, "spread")
            with ThreadPoolExecutor(40) as pool:
                statuses = list(pool.map(lambda _: complete(url, key), range(40)))
            assert statuses == [200] * 40
            served = served_by_process(url)
            assert set(served) == {"0", "1"} and min(served.values()) > 0, served
            assert sum(served.values()) >= 40
            # Both processes had requests waiting and used their shares, never more.
            assert 2 <= backend.peak <= MAX_INFLIGHT, backend.peak
            port = int(url.rsplit(":", 1)[1])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children + redis, timeout=15)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        check_port_free("127.0.0.1", port, "--port")  # raises if anything still holds it
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        assert "[2, 1]" in text  # the per-process shares are logged at start
        assert not list((data_dir / "gateway-procs").glob("*/*.json"))


@pytest.mark.timeout(240)
def test_a_killed_process_is_restarted_and_the_gateway_keeps_answering(tmp_path, redis_url):
    with serving(FakeBackend(name="small0")) as backend_url:
        cfg = {
            "pools": {"small": [backend_url]},
            "admin_key": ADMIN,
            "data_dir": str(tmp_path / "data"),
            "redis_url": redis_url,
            "load_poll_interval_s": 0.05,
        }
        with gateway_group(cfg, tmp_path) as (url, proc, log):
            assert eventually(lambda: processes_in_metrics(url) == {"0", "1"}, 60)
            key = tenant_key(url, "restart")
            victim, survivor = members(proc)
            victim.kill()
            victim.wait(10)
            # The kernel gives new connections to the listening survivor meanwhile.
            assert [complete(url, key) for _ in range(10)] == [200] * 10
            pids = lambda: {p.pid for p in members(proc)}  # noqa: E731
            assert eventually(lambda: len(pids()) == 2 and victim.pid not in pids(), 30)
            assert survivor.pid in pids()
            assert eventually(lambda: processes_in_metrics(url) == {"0", "1"}, 60)
            assert [complete(url, key) for _ in range(10)] == [200] * 10
            text = log.read_text()
            assert f"(pid {victim.pid}) exited unexpectedly (SIGKILL); restarting" in text


# -- the supervisor, over stand-in members (python -c, no gateway) --------------------------

# A member that reads its spec, records itself as up, and waits for SIGTERM (exit 0).
_SERVES = """
import os, pickle, signal, sys, pathlib
spec = pickle.load(sys.stdin.buffer)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path(spec.procs_dir, f"{os.getpid()}.json").write_text("{}")
signal.pause()
"""


def _specs(tmp_path: Path, n: int) -> list[MemberSpec]:
    config = GatewayConfig(pools={"small": ["http://w"]}, processes=n)
    return [
        MemberSpec(c, "127.0.0.1", 1, i, n, str(tmp_path))
        for i, c in enumerate(member_configs(config, "redis://r"))
    ]


@pytest.mark.timeout(60)
def test_a_member_failing_before_any_served_stops_the_group_with_status_1(tmp_path):
    group = ProcessGroup(_specs(tmp_path, 2), [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert group.run() == 1
    assert group.pids() == []


@pytest.mark.timeout(60)
def test_a_member_dying_after_serving_is_restarted_and_a_signal_stops_all(tmp_path):
    group = ProcessGroup(
        _specs(tmp_path, 2), [sys.executable, "-c", _SERVES], RestartPolicy(base_s=0.05)
    )
    # run() installs its signal handlers, so it runs on the main thread; a helper thread
    # kills a member, waits for its restart, then signals the group (always, so run() ends).
    seen: dict[str, object] = {}

    def drive() -> None:
        try:
            seen["up"] = eventually(lambda: all(m.up for m in group.members), 20)
            first = group.pids()
            os.kill(first[0], signal.SIGKILL)
            seen["restarted"] = eventually(
                lambda: (
                    first[0] not in group.pids()
                    and len(group.pids()) == 2
                    and all(m.up for m in group.members)
                ),
                20,
            )
            seen["kept"] = first[1] in group.pids()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=drive)
    helper.start()
    status = group.run()
    helper.join(10)
    assert seen == {"up": True, "restarted": True, "kept": True}
    assert status == 0
    assert [m.num_crashes for m in group.members] == [1, 0]
    assert group.pids() == [] and not list(tmp_path.glob("*.json"))
