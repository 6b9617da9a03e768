"""The standalone `switchyard gateway` process stops cleanly: SIGTERM or SIGINT stops its
embedded Redis too (no orphaned redis-server), with no traceback."""

import signal

import psutil
import pytest

from benchmarks.fake_backend import FakeBackend
from tests.integration.gateway.conftest import ADMIN
from tests.support.servers import gateway_proc, serving


def _redis_servers_under(path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline", "cwd"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "redis-server" in (p.info["name"] or "") + text and str(path) in text:
            found.append(p)
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_gateway_and_its_embedded_redis(tmp_path, sig):
    data_dir = tmp_path / "data"
    with serving(FakeBackend()) as backend:
        cfg = {"pools": {"small": [backend]}, "admin_key": ADMIN, "data_dir": str(data_dir)}
        with gateway_proc(cfg, tmp_path, ready_timeout_s=90) as (_url, proc):
            redis = _redis_servers_under(data_dir)
            assert redis, "the gateway runs an embedded redis-server under its data dir"
            proc.send_signal(sig)
            proc.wait(30)
    gone, alive = psutil.wait_procs(redis, timeout=10)
    assert not alive, f"orphaned: {[p.pid for p in alive]}"
    log = next(tmp_path.glob("gateway-*.log")).read_text()
    assert "Traceback" not in log, log[-2000:]
