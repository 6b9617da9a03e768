"""The standalone `switchyard gateway` process stops cleanly: SIGTERM or SIGINT stops its
embedded Redis too (no orphaned redis-server), with no traceback; and its log lines follow
`--log-format`."""

import json
import signal

import httpx
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


@pytest.mark.timeout(240)
def test_the_access_line_is_one_json_object_with_log_format_json(tmp_path):
    """`--log-format json` holds for the gateway's own lines, the access line included (the
    web framework must not swap the process's log handler for its own). A stream's line
    says when its first token came and when admission predicted it would."""
    fake = FakeBackend()
    fake.seats, fake.decode_step_s, fake.prefill_tokens_per_s = 8, 0.01, 1000.0
    with serving(fake) as backend:
        cfg = {
            "pools": {"small": [backend]},
            "ttft_target_s": {"small": 2.0},
            "admin_key": ADMIN,
            "data_dir": str(tmp_path),
        }
        args = ("--log-format", "json")
        with gateway_proc(cfg, tmp_path, global_args=args) as (url, proc):
            admin = {"authorization": f"Bearer {ADMIN}"}
            r = httpx.post(f"{url}/admin/tenants", json={"tenant_id": "acme"}, headers=admin)
            assert r.status_code == 201, r.text
            r = httpx.post(f"{url}/admin/tenants/acme/keys", json={"name": "t"}, headers=admin)
            key = r.json()["key"]
            body = {"model": "small", "prompt": "hello", "max_tokens": 3}
            r = httpx.post(
                f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
            body = {**body, "stream": True}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body,
                headers={"authorization": f"Bearer {key}"},
            ) as s:  # fmt: skip
                assert s.status_code == 200 and "[DONE]" in s.read().decode()
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    lines = next(tmp_path.glob("gateway-*.log")).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines), [line for line in lines if not line.startswith("{")]
    access = [r for r in records if r["logger"] == "gateway.access"]
    tokens = 3 + r.json()["usage"]["prompt_tokens"]
    assert [(a["path"], a["tenant"], a["status"], a["tokens"]) for a in access] == [
        ("/v1/completions", "acme", 200, tokens),
        ("/v1/completions", "acme", 200, tokens),
    ]
    plain, stream = access
    assert "ttft_ms" not in plain and "predicted_ttft_ms" not in plain
    assert 0 <= stream["ttft_ms"] <= stream["latency_ms"]
    assert 0 < stream["predicted_ttft_ms"] < 2000
