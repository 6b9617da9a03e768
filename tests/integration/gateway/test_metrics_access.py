"""`/metrics` names tenants and their traffic: over real HTTP it answers loopback peers (the
default `metrics_networks`) and requests carrying the metrics token, and is an OpenAI-shaped
401 to anyone else: a client reaching the gateway at this host's own non-loopback address,
or one a local proxy forwards (`X-Forwarded-For`, which uvicorn trusts from loopback)."""

import socket
import tempfile
from contextlib import contextmanager

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.metrics import MetricsAccess
from gateway.runtime.main import build_gateway
from tests.integration.gateway.conftest import _flush, _wait_ready
from tests.support.servers import serving
from tests.support.worker import free_port

TOKEN = "metrics-secret"
PROXIED = {"x-forwarded-for": "203.0.113.9"}


def _outside_address() -> str | None:
    """This host's own address on a non-loopback interface, if it has one."""
    for target in ("10.255.255.255", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))  # no packet is sent: this only picks a route
            except OSError:
                continue
            address = s.getsockname()[0]
        if not address.startswith("127."):
            return address
    return None


@contextmanager
def _gateway(redis_url: str, **config):
    """A gateway listening on every interface (so a non-loopback peer can reach it)."""
    _flush(redis_url)
    with serving(FakeBackend(name="small0")) as backend, tempfile.TemporaryDirectory() as data:
        cfg = GatewayConfig(pools={"small": [backend]}, data_dir=data, door=False, **config)
        gw = build_gateway(cfg, redis_url)
        port = free_port()
        with serving(create_gateway_app(gw), host="0.0.0.0", port=port):
            _wait_ready(f"http://127.0.0.1:{port}")
            yield port


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "metrics_unauthorized"
    assert "switchyard_gateway" not in r.text


def test_metrics_answer_loopback_and_refuse_a_proxied_or_outside_client(redis_url):
    outside = _outside_address()
    with _gateway(redis_url) as port:
        local = f"http://127.0.0.1:{port}/metrics"
        assert "switchyard_gateway_requests_total" in httpx.get(local).text
        _refused(httpx.get(local, headers=PROXIED))
        _refused(httpx.get(local, headers={**PROXIED, "authorization": "Bearer anything"}))
        if outside is not None:
            _refused(httpx.get(f"http://{outside}:{port}/metrics"))
        assert httpx.get(f"http://127.0.0.1:{port}/health", headers=PROXIED).status_code == 200


def test_the_metrics_token_opens_metrics_to_any_address_and_only_the_right_one(redis_url):
    outside = _outside_address()
    with _gateway(redis_url, metrics_token=TOKEN, metrics_networks=[]) as port:
        local = f"http://127.0.0.1:{port}/metrics"
        _refused(httpx.get(local))  # no networks: the token only, loopback included
        _refused(httpx.get(local, headers={"authorization": "Bearer metrics-secreT"}))
        _refused(httpx.get(local, headers={"authorization": f"Basic {TOKEN}"}))
        ok = httpx.get(local, headers={**PROXIED, "authorization": f"bearer {TOKEN}"})
        assert ok.status_code == 200 and "switchyard_gateway_requests_total" in ok.text
        if outside is not None:
            r = httpx.get(
                f"http://{outside}:{port}/metrics", headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert r.status_code == 200


def test_an_operator_network_may_scrape_without_the_token(redis_url):
    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no non-loopback address to scrape from")
    with _gateway(redis_url, metrics_networks=[f"{outside}/32"]) as port:
        assert httpx.get(f"http://{outside}:{port}/metrics").status_code == 200
        _refused(httpx.get(f"http://127.0.0.1:{port}/metrics"))  # loopback is not listed


def test_metrics_access_rules():
    access = MetricsAccess(TOKEN, ["127.0.0.0/8", "::1/128", "10.1.0.0/16"])
    assert access.allows("127.0.0.1", "") and access.allows("::1", "")
    assert access.allows("::ffff:127.0.0.1", "") and access.allows("10.1.2.3", "")
    assert not access.allows("10.2.0.1", "") and not access.allows("testclient", "")
    assert not access.allows(None, "") and access.allows(None, f"Bearer {TOKEN}")
    assert not access.allows("203.0.113.9", f"Bearer {TOKEN}x")
    assert not MetricsAccess(None, []).allows("127.0.0.1", "Bearer ")
    with pytest.raises(ValueError):
        MetricsAccess(None, ["not-a-network"])
    with pytest.raises(ValueError):
        MetricsAccess(None, "10.0.0.0/8")  # a YAML string where a list belongs
