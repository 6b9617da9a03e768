"""`switchyard bench multihost`: two gateways on two hosts in front of workers on both.

Two hosts are two network namespaces joined by a veth pair (the test suite's harness,
`tests/support/netns.py`: it needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN). Host A runs
Redis, a fake backend and a gateway; host B a fake backend and a gateway. The backends join
pool `small` through the fleet's Redis as `switchyard worker --join` does (heartbeats with a
TTL, `benchmarks/fake_backend.py --join`), and both gateways take the pool's members from
that Redis (`membership.enabled`, no static URL): each gateway sends to both hosts' backends,
one of them across the veth. The backend stands in for a worker, as in `bench gateway`.

1. The gateway's cost, side by side in one run (`gateway_load.measure_path`, as `bench
   gateway` measures it): host A's backend direct; through gateway A; through gateway B;
   then both gateways under wrk at once, each from its own host, with their throughputs
   summed.
2. Death to removal: host B's backend SIGKILLed (no withdrawal) `trials` times; each time,
   how long until each gateway's `/admin/fleet` no longer lists it, against the bound the
   design states (the member's TTL plus the gateways' poll). Between trials it is started
   again and waited for on both gateways.
"""

import json
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from benchmarks.gateway_bench import load_plan
from benchmarks.gateway_load import LoadPlan, measure_path, wrk_cells
from benchmarks.gateway_paths import ADMIN, BenchPath, make_key, wait_ready
from benchmarks.stats import markdown_table, percentile, write_report

log = logging.getLogger(__name__)

POOL = "small"
GATEWAY_PORT = 8000
BACKEND_PORT = 8101


@dataclass
class MultiHostOptions:
    out_dir: Path
    quick: bool = False  # a smoke run with tiny numbers; its figures mean nothing
    trials: int = 10  # deaths of host B's backend
    ttl_s: float = 2.0  # the backends' heartbeat TTL
    poll_s: float = 0.5  # the gateways' membership re-read


def _harness():
    """The two-host harness; raises with the reason where this machine cannot make hosts."""
    root = str(Path(__file__).resolve().parents[1])  # the checkout: the harness is its tests'
    if root not in sys.path:
        sys.path.append(root)
    try:
        from tests.support import netns
    except ImportError as exc:
        raise RuntimeError(f"the two-host harness (tests/support/netns.py): {exc}") from exc
    why = netns.missing_capability()
    if why is not None:
        raise RuntimeError(f"cannot make two hosts here: {why}")
    return netns


def _members(gateway: str) -> dict[str, str]:
    """URL -> state of the pool's members as `gateway` has them."""
    headers = {"authorization": f"Bearer {ADMIN}"}
    fleet = httpx.get(f"{gateway}/admin/fleet", headers=headers, timeout=5).json()
    return {w["url"]: w["state"] for w in fleet[POOL]["workers"]}


def _wait(condition: Callable[[], bool], timeout_s: float, what: str, step_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(step_s)


class Fleet:
    """The hosts and what runs on them."""

    def __init__(self, hosts, redis_url: str, tmp: Path, opts: MultiHostOptions) -> None:
        self.hosts = {"a": hosts.a, "b": hosts.b}
        self.redis_url = redis_url
        self.tmp = tmp
        self.opts = opts
        self.backends: dict[str, subprocess.Popen] = {}
        self.gateways: dict[str, subprocess.Popen] = {}

    def backend_url(self, name: str) -> str:
        return f"http://{self.hosts[name].address}:{BACKEND_PORT}"

    def gateway_url(self, name: str) -> str:
        return f"http://{self.hosts[name].address}:{GATEWAY_PORT}"

    def call(self, name: str, fn: Callable[[], Any]) -> Any:
        return self.hosts[name].call(fn)

    def start_backend(self, name: str) -> None:
        host = self.hosts[name]
        argv = [sys.executable, "-m", "benchmarks.fake_backend", "--host", host.address]
        argv += ["--port", str(BACKEND_PORT), "--join", self.redis_url, "--pool", POOL]
        argv += ["--join-ttl", str(self.opts.ttl_s), "--host-id", f"host-{name}"]
        out = open(self.tmp / f"backend-{name}.log", "ab")  # noqa: SIM115 (the child's)
        self.backends[name] = host.popen(argv, stdout=out, stderr=subprocess.STDOUT)
        url = self.backend_url(name)
        self.call(name, lambda: wait_ready(url, "/health", {}, 30.0, self.backends[name]))

    def start_gateway(self, name: str) -> None:
        host = self.hosts[name]
        cfg = {
            "pools": {POOL: []},
            "redis_url": self.redis_url,
            "admin_key": ADMIN,
            "load_poll_interval_s": 0.1,
            "membership": {"enabled": True, "ttl_s": self.opts.ttl_s, "poll_s": self.opts.poll_s},
        }
        path = self.tmp / f"gateway-{name}.yaml"
        path.write_text(yaml.safe_dump({"gateway": cfg}))
        argv = [sys.executable, "-m", "cli.main", "gateway", "--config", str(path)]
        argv += ["--host", host.address, "--port", str(GATEWAY_PORT)]
        log_path = self.tmp / f"gateway-{name}.log"
        out = open(log_path, "ab")  # noqa: SIM115 (the child's)
        self.gateways[name] = host.popen(argv, stdout=out, stderr=subprocess.STDOUT)
        url, proc = self.gateway_url(name), self.gateways[name]
        self.call(name, lambda: wait_ready(url, "/ready", {}, 120.0, proc, log_path))

    def members(self, via: str) -> dict[str, str]:
        url = self.gateway_url(via)
        return self.call(via, lambda: _members(url))

    def wait_members(self, present: set[str], absent: set[str], timeout_s: float) -> None:
        """Until every gateway routes to each of `present` and lists none of `absent`."""
        for via in self.gateways:

            def seen(via: str = via) -> bool:
                now = self.members(via)
                ready = {u for u, s in now.items() if s in ("ready", "starting")}
                return present <= ready and not absent & now.keys()

            _wait(seen, timeout_s, f"gateway {via}: members {sorted(present)}", step_s=0.05)


def _path(fleet: Fleet, name: str, via: str | None, key: str) -> BenchPath:
    if via is None:
        return BenchPath(name, fleet.backend_url("a"), pids=[fleet.backends["a"].pid])
    headers = {"authorization": f"Bearer {key}"}
    return BenchPath(name, fleet.gateway_url(via), headers, pids=[fleet.gateways[via].pid])


def measure_cost(fleet: Fleet, plan: LoadPlan, steps: tqdm) -> dict:
    key = fleet.call("a", lambda: make_key(fleet.gateway_url("a"), "bench-multihost"))
    rows: dict[str, Any] = {}
    for name, via, host in [
        ("direct (host A's backend)", None, "a"),
        ("gateway A", "a", "a"),
        ("gateway B", "b", "b"),
    ]:
        path = _path(fleet, name, via, key)
        rows[name] = fleet.call(host, lambda p=path: measure_path(p, plan))
        steps.update()
    results: dict[str, Any] = {}

    def both(via: str) -> None:
        path = _path(fleet, f"gateway {via.upper()}", via, key)
        results[via] = fleet.call(via, lambda: wrk_cells(path, plan))

    threads = [threading.Thread(target=both, args=(v,)) for v in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows["both gateways at once"] = {"wrk": _summed(results["a"], results["b"])}
    steps.update()
    return rows


def _summed(a: list[dict], b: list[dict]) -> list[dict]:
    """wrk rows of two gateways run at once: requests and requests/s summed, latencies the
    worse of the two, CPU per request their mean."""
    out = []
    for x, y in zip(a, b, strict=True):
        row: dict[str, Any] = {"mode": x["mode"], "connections": x["connections"]}
        if "error" in x or "error" in y:
            row["error"] = x.get("error") or y.get("error")
        else:
            row |= {k: x[k] + y[k] for k in ("rps", "requests", "errors")}
            row |= {k: max(x[k], y[k]) for k in ("p50_ms", "p99_ms")}
            row["cpu_ms_per_request"] = (x["cpu_ms_per_request"] + y["cpu_ms_per_request"]) / 2
        out.append(row)
    return out


def measure_removal(fleet: Fleet, trials: int, steps: tqdm) -> dict:
    """SIGKILL host B's backend; per gateway, seconds until it is out of the rotation."""
    url = fleet.backend_url("b")
    both = {fleet.backend_url("a"), url}
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(trials):
        fleet.wait_members(both, set(), 60.0)
        killed = time.monotonic()
        fleet.backends["b"].send_signal(signal.SIGKILL)
        fleet.backends["b"].wait()
        gone: dict[str, float] = {}

        def watch(via: str, gone: dict[str, float] = gone, killed: float = killed) -> None:
            _wait(lambda: url not in fleet.members(via), 60.0, f"removal on {via}", 0.01)
            gone[via] = time.monotonic() - killed

        threads = [threading.Thread(target=watch, args=(v,)) for v in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for via in ("a", "b"):
            times[via].append(gone[via])
        fleet.start_backend("b")
        steps.update()
    fleet.wait_members(both, set(), 60.0)
    bound = fleet.opts.ttl_s + fleet.opts.poll_s
    return {
        "bound_s": bound,
        "ttl_s": fleet.opts.ttl_s,
        "poll_s": fleet.opts.poll_s,
        "seconds": times,
        "summary": {
            via: {"p50_s": percentile(ts, 50), "max_s": max(ts), "within_bound": max(ts) <= bound}
            for via, ts in times.items()
        },
    }


def run_multihost_bench(opts: MultiHostOptions) -> dict:
    netns = _harness()
    plan = load_plan(opts.quick)
    trials = 2 if opts.quick else opts.trials
    data: dict[str, Any] = {"options": {**opts.__dict__, "out_dir": str(opts.out_dir)}}
    with tempfile.TemporaryDirectory() as tmp_name, netns.two_hosts() as hosts:
        tmp = Path(tmp_name)
        redis_url = netns.start_redis(hosts.a, tmp / "redis")
        fleet = Fleet(hosts, redis_url, tmp, opts)
        with tqdm(total=4 + trials, desc="bench multihost", unit="step") as steps:
            for name in ("a", "b"):
                fleet.start_backend(name)
                fleet.start_gateway(name)
            fleet.wait_members({fleet.backend_url("a"), fleet.backend_url("b")}, set(), 60.0)
            data["cost"] = measure_cost(fleet, plan, steps)
            data["removal"] = measure_removal(fleet, trials, steps)
    markdown = report(data)
    json_path, md_path = write_report(opts.out_dir, "multihost", data, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def report(data: dict) -> str:
    lines = ["# Two gateways on two hosts, in front of workers on both", ""]
    rows = []
    for name, r in data["cost"].items():
        lat = r.get("latency_ms", {})
        row: dict[str, Any] = {"path": name}
        for mode in ("plain", "stream"):
            if isinstance(lat.get(mode), dict):
                row[f"{mode}_p50"] = lat[mode]["p50"]
                row[f"{mode}_p99"] = lat[mode]["p99"]
        for cell in r.get("wrk", []):
            tag = f"{cell['mode']}_{cell['connections']}"
            row[f"rps_{tag}"] = cell.get("rps", cell.get("error", "")[:40])
            if cell["mode"] == "plain" and "cpu_ms_per_request" in cell:
                row[f"cpu_{tag}"] = cell["cpu_ms_per_request"]
        rows.append(row)
    cols = [("path", "path")]
    cols += [
        (f"{m}_{q}", f"{m} {q} ms (one at a time)")
        for m in ("plain", "stream")
        for q in ("p50", "p99")
    ]
    for key in sorted({k for r in rows for k in r if k.startswith(("rps_", "cpu_"))}):
        what, mode, conns = key.split("_")
        unit = "req/s" if what == "rps" else "CPU ms/request"
        cols.append((key, f"{mode} c={conns} {unit}"))
    lines.append(markdown_table(rows, cols))
    rem = data["removal"]
    lines += [
        "",
        f"## A backend's death to its removal (SIGKILL, no withdrawal; TTL {rem['ttl_s']} s, "
        f"poll {rem['poll_s']} s: bound {rem['bound_s']} s)",
        "",
        markdown_table(
            [
                {"gateway": via, **s, "trials": len(rem["seconds"][via])}
                for via, s in rem["summary"].items()
            ],
            [
                ("gateway", "gateway on host"),
                ("trials", "deaths"),
                ("p50_s", "p50 s"),
                ("max_s", "max s"),
                ("within_bound", "every one within the bound"),
            ],
        ),
        "",
        "Seconds, each death: " + json.dumps(rem["seconds"]),
    ]
    return "\n".join(lines)
