"""Bad input to the usage and admin endpoints is a 4xx in the OpenAI error shape, never a
500: times that are not finite, or outside 1970..9999, and counts in non-ASCII digits; and an
admin body that does not arrive in time is a 408, not a connection held open."""

import json
import socket
import time

import pytest

from tests.integration.gateway.conftest import ADMIN, gateway_stack

BODY_S = 0.5

BAD_QUERIES = [
    ({"start": "nan"}, "start"),
    ({"end": "nan"}, "end"),
    ({"start": "-nan", "end": "nan"}, "end"),
    ({"end": "inf"}, "end"),
    ({"start": "-inf"}, "start"),
    ({"start": "1e300"}, "start"),
    ({"end": "-1"}, "end"),
    ({"start": "0001-01-01T00:00:00+14:00"}, "start"),
    ({"recent": "²"}, "recent"),
    ({"recent": "1e3"}, "recent"),
]


@pytest.mark.parametrize(("query", "param"), BAD_QUERIES)
def test_bad_usage_times_and_counts_are_400_naming_the_parameter(stack, query, param):
    key = stack.tenant("acme")
    with stack.client(key) as c, stack.admin() as admin:
        for client, path in ((c, "/v1/usage"), (admin, "/admin/usage")):
            r = client.get(path, params=query)
            assert r.status_code == 400, (path, query, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_times_in_range_parse_and_the_span_bound_still_holds(stack):
    key = stack.tenant("acme")
    now = time.time()
    with stack.client(key) as c:
        r = c.get("/v1/usage", params={"start": str(now - 3600), "end": "2262-01-01"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "start"  # > 400 days
        r = c.get("/v1/usage", params={"start": f"{now - 86400:.3f}", "recent": "3"})
        assert r.status_code == 200, r.text


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/admin/tenants"),
        ("PATCH", "/admin/tenants/acme"),
        ("PUT", "/admin/tenants/acme"),
        ("POST", "/admin/tenants/acme/keys"),
    ],
)
def test_an_admin_body_that_does_not_arrive_is_408_after_the_body_timeout(redis_url, method, path):
    with gateway_stack(redis_url, replicas={"small": 1}, body_timeout_s=BODY_S) as s:
        s.tenant("acme")
        body = json.dumps({"tenant_id": "late", "limits": {}}).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with _connect(s.url) as sock:
            t0 = time.monotonic()
            sock.sendall(head + body[:5])
            sock.settimeout(BODY_S + 5)
            raw = b""
            while b"\r\n\r\n" not in raw:
                chunk = sock.recv(4096)
                assert chunk, f"closed without an answer: {raw!r}"
                raw += chunk
            took = time.monotonic() - t0
        assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
        assert took < BODY_S + 2.0, took
        payload = raw.split(b"\r\n\r\n", 1)[1]
        if payload:
            assert b'"code":"timeout"' in payload.replace(b" ", b""), payload
        with s.admin() as admin:
            assert admin.get("/admin/tenants/late").status_code == 404  # nothing created
