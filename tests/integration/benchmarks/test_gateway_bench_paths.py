"""`switchyard bench gateway`'s moving parts against a real fake backend: wrk's driver and
a peer gateway started from a `--peer-cmd` template (here the fake backend itself)."""

import sys
from pathlib import Path

import psutil
import pytest

from benchmarks.gateway_load import WRK_BODIES
from benchmarks.gateway_paths import PeerOptions, peer_path
from benchmarks.wrk import cpu_seconds, run_wrk, wrk_path
from tests.support.servers import backend_proc
from tests.support.waiting import eventually

NO_WRK = "wrk is not installed (scripts/setup.sh installs it as root: apt-get install wrk)"


@pytest.mark.parametrize("mode", ["plain", "stream"])
def test_wrk_drives_the_fake_backend_without_errors_and_measures_itself(mode: str) -> None:
    assert wrk_path() is not None, NO_WRK
    with backend_proc() as (url, proc):
        c0 = cpu_seconds([proc.pid])
        r = run_wrk(f"{url}/v1/completions", WRK_BODIES[mode], {}, connections=4, duration_s=1)
        assert r.requests > 0 and r.errors == 0
        assert 0 < r.p50_ms <= r.p99_ms
        assert r.cpu_s > 0  # wrk's own CPU, read when it was reaped
        assert cpu_seconds([proc.pid]) > c0  # the backend's, from /proc


def test_wrk_counts_error_answers() -> None:
    assert wrk_path() is not None, NO_WRK
    with backend_proc() as (url, _):
        r = run_wrk(f"{url}/no-such-path", WRK_BODIES["plain"], {}, connections=2, duration_s=1)
        assert r.requests > 0 and r.errors == r.requests


def test_peer_cmd_is_started_with_its_placeholders_measured_and_stopped(tmp_path: Path) -> None:
    with backend_proc() as (backend, _):
        cmd = (
            f"echo {{backend}} > {{dir}}/backend.txt && "
            f"exec {sys.executable} -m benchmarks.fake_backend --port {{port}}"
        )
        opts = PeerOptions(cmd=cmd, ready_path="/health", ready_timeout_s=30)
        with peer_path(opts, backend, tmp_path) as path:
            assert (tmp_path / "peer" / "backend.txt").read_text().strip() == backend
            assert path.name == "peer" and path.url != backend
            assert path.headers == {"authorization": "Bearer sk-switchyard-bench"}
            (pid,) = path.pids
            assert "benchmarks.fake_backend" in " ".join(psutil.Process(pid).cmdline())
        assert eventually(lambda: _gone(pid), timeout_s=5)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_peer_cmd_that_exits_fails_with_its_output(tmp_path: Path) -> None:
    opts = PeerOptions(cmd="echo cannot start on {port}; exit 3", ready_timeout_s=30)
    with pytest.raises(RuntimeError, match=r"exited with 3 before ready: cannot start on \d+"):
        with peer_path(opts, "http://127.0.0.1:1", tmp_path):
            pass
