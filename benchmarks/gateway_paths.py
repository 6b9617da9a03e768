"""The paths `switchyard bench gateway` measures side by side, each a context manager that
starts what it needs and yields a `BenchPath`: the fake backend alone (`direct`), a
Switchyard gateway of one or more processes, and a peer gateway (one the bench starts from
a command template, or one already running)."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.processes import child_process, free_port

ADMIN = "bench-admin"
PEER_DUMMY_KEY = "sk-switchyard-bench"  # sent to a peer when no --peer-key is given


@dataclass
class BenchPath:
    """One way to reach the fake backend, and whose CPU it costs."""

    name: str  # "direct" | "switchyard" | "switchyard x2" | "peer"
    url: str  # base URL; requests go to url + /v1/completions
    headers: dict[str, str] = field(default_factory=dict)  # the bearer token, if any
    model: str = "small"  # what requests put in "model"
    pids: list[int] = field(default_factory=list)  # their process trees' CPU is the path's cost
    extra_pids: list[int] = field(default_factory=list)  # shared helpers (Redis), reported apart


def render_peer_cmd(template: str, backend: str, port: int, workdir: Path) -> str:
    """`template` with {backend} (the fake backend's base URL, no /v1), {port} (a free port
    for the peer) and {dir} (a scratch directory) filled in; other braces are left alone,
    so shell `${VAR}` and YAML flow maps in the template survive."""
    values = {"{backend}": backend, "{port}": str(port), "{dir}": str(workdir)}
    out = template
    for placeholder, value in values.items():
        out = out.replace(placeholder, value)
    return out


def wait_ready(
    url: str,
    path: str,
    headers: dict[str, str],
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll `url + path` until it answers 200; fail early, with the log's tail, if `proc`
    exits first."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + path, headers=headers, timeout=2)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.TransportError as e:
            last = type(e).__name__
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-1500:] if log_path else ""
            raise RuntimeError(f"exited with {proc.returncode} before ready: {tail}")
        time.sleep(0.2)
    raise RuntimeError(f"{url}{path} not ready after {timeout_s:.0f} s ({last})")


def make_key(gateway: str, tenant: str, **limits) -> str:
    """A fresh tenant (no limits unless given) and an API key of it."""
    h = {"authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{gateway}/admin/tenants", json={"tenant_id": tenant, "limits": limits}, headers=h)
    r = httpx.post(f"{gateway}/admin/tenants/{tenant}/keys", json={}, headers=h)
    r.raise_for_status()
    return r.json()["key"]


def redis_pid(redis_url: str) -> int | None:
    """The process id of the Redis server at `redis_url` (None if it does not say)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


@contextmanager
def gateway_process(
    tmp: Path, backend: str, redis_url: str, **gateway_cfg
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `switchyard gateway` process in front of `backend`; yields (URL, process) once
    /ready answers, or raises with the tail of its log if it exits first."""
    port = free_port()
    cfg = {
        "pools": {"small": [backend]},
        "redis_url": redis_url,
        "admin_key": ADMIN,
        "load_poll_interval_s": 0.1,
        **gateway_cfg,
    }
    cfg_path = tmp / f"gateway-{port}.yaml"
    cfg_path.write_text(yaml.safe_dump({"gateway": cfg}))
    log_path = tmp / f"gateway-{port}.log"
    cmd = [sys.executable, "-m", "cli.main", "gateway", "--config", str(cfg_path)]
    with child_process([*cmd, "--port", str(port)], log_path) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, "/ready", {}, 120.0, proc, log_path)
        yield url, proc


@contextmanager
def switchyard_path(
    name: str,
    tmp: Path,
    backend: str,
    redis_url: str,
    budget: dict | None = None,
    **gateway_cfg: Any,
) -> Iterator[BenchPath]:
    """`budget`: the bench tenant's money budget (`PUT`'s form), for a priced gateway."""
    with gateway_process(tmp, backend, redis_url, **gateway_cfg) as (url, proc):
        tenant = f"bench-{proc.pid}"
        key = make_key(url, tenant)
        if budget is not None:
            h = {"authorization": f"Bearer {ADMIN}"}
            r = httpx.patch(f"{url}/admin/tenants/{tenant}", json={"budget": budget}, headers=h)
            r.raise_for_status()
        yield BenchPath(
            name,
            url,
            {"authorization": f"Bearer {key}"},
            pids=[proc.pid],
            extra_pids=[pid] if (pid := redis_pid(redis_url)) else [],
        )


@dataclass
class PeerOptions:
    """A peer gateway: one started by hand (`url`) or one the bench starts (`cmd`)."""

    url: str | None = None  # already running, in front of the bench's fake backend
    pid: int | None = None  # its process, for the CPU figure (None: no CPU figure)
    cmd: str | None = None  # a shell command template: {backend}, {port}, {dir}
    ready_path: str = "/health"  # polled (with the key) until it answers 200
    key: str | None = None  # bearer token sent to it (None: a dummy)
    model: str = "small"  # the model name sent to it
    ready_timeout_s: float = 180.0

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key or PEER_DUMMY_KEY}"}


@contextmanager
def peer_path(opts: PeerOptions, backend: str, tmp: Path) -> Iterator[BenchPath]:
    """The peer as a `BenchPath`: started from `opts.cmd` (in its own process group, so its
    whole tree is measured and stopped) or reached at `opts.url`."""
    if opts.cmd is None:
        assert opts.url is not None
        url = opts.url.rstrip("/")
        wait_ready(url, opts.ready_path, opts.headers, opts.ready_timeout_s)
        yield BenchPath("peer", url, opts.headers, opts.model, [opts.pid] if opts.pid else [])
        return
    port = free_port()
    workdir = tmp / "peer"
    workdir.mkdir(exist_ok=True)
    cmd = render_peer_cmd(opts.cmd, backend, port, workdir)
    log_path = tmp / "peer.log"
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            cmd, shell=True, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, opts.ready_path, opts.headers, opts.ready_timeout_s, proc, log_path)
        yield BenchPath("peer", url, opts.headers, opts.model, [proc.pid])
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Interrupt the peer's process group (the shell and whatever it started); kill what is
    left after `grace_s`."""
    pgid = proc.pid  # start_new_session: the shell leads its own group
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the shell, so a zombie does not keep the group alive
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    proc.poll()
