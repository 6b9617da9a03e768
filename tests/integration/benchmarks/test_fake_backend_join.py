"""The fake backend's `--join` (what `bench multihost` stands its workers in with): it is a
live, ready member of its pool in a real Redis while it runs and answers, and SIGTERM
withdraws it rather than leaving it to expire."""

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from benchmarks.fake_backend import FAKE_FINGERPRINT
from benchmarks.processes import free_port
from tests.support.redis_server import redis_url
from tests.support.serve_stack import wait_for
from tests.support.servers import REPO_ROOT, wait_ready
from workers.api.membership import PoolMembers
from workers.api.membership_store import MembershipStore, membership_redis


def _read(url: str, pool: str) -> PoolMembers:
    async def read() -> PoolMembers:
        client = membership_redis(url)
        try:
            return (await MembershipStore(client).read([pool]))[pool]
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_a_joined_fake_backend_is_a_member_until_it_withdraws(tmp_path: Path) -> None:
    port = free_port()
    backend = f"http://127.0.0.1:{port}"
    with redis_url() as url:
        argv = [sys.executable, "-m", "benchmarks.fake_backend", "--port", str(port)]
        argv += ["--join", url, "--pool", "small", "--join-ttl", "2", "--host-id", "here"]
        log = open(tmp_path / "backend.log", "wb")  # noqa: SIM115 (the child's)
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(backend, timeout_s=30, proc=proc, path="/health")
            wait_for(
                lambda: [m.record.url for m in _read(url, "small").members] == [backend],
                15,
                "the backend announced",
                step_s=0.02,
            )
            members = _read(url, "small")
            record = members.members[0].record
            assert (record.host_id, record.state, record.fingerprint) == (
                "here",
                "ready",
                FAKE_FINGERPRINT,
            )
            assert members.fingerprint == FAKE_FINGERPRINT
            r = httpx.post(
                f"{backend}/v1/completions",
                json={"model": "small", "prompt": [5, 6], "max_tokens": 2},
                timeout=10,
            )
            assert r.status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
            # Withdrawn on the way out (a tombstone until its TTL), not left to expire.
            assert [m.record.state for m in _read(url, "small").members] == ["withdrawn"]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
