"""Client-side faults: slow clients (partial or trickled head, partial body, idle
keep-alive) and the client's deadline on a hung worker; invalid deadline headers."""

import json
import socket
import time

import pytest

from benchmarks.fake_backend import FakeBackend
from tests.integration.gateway.conftest import gateway_stack
from tests.integration.gateway.faults_support import (
    BIG,
    BODY,
    assert_books,
    gateway_over,
    send,
    stream_body,
    this_minute,
    usage,
    wait_until,
)
from tests.support.servers import serving
from tests.support.waiting import closed_after

# -- 7. Slow clients ------------------------------------------------------------------------

HEADER_S, KEEP_ALIVE_S, BODY_S = 2.0, 1.0, 0.5


@pytest.fixture
def bounded(redis_url):
    """An in-process gateway served as the gateway process serves it (head, keep-alive and
    body timeouts), over one fake backend."""
    with (
        serving(FakeBackend(name="small0")) as b,
        gateway_over(
            redis_url,
            {"small": [b]},
            body_timeout_s=BODY_S,
            server={
                "header_timeout_s": HEADER_S,
                "keep_alive_timeout_s": KEEP_ALIVE_S,
                "shutdown_grace_s": 1,
            },
        ) as s,
    ):
        yield s


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


@pytest.mark.timeout(30)
def test_partial_request_head_is_closed_after_header_timeout(bounded):
    with _connect(bounded.url) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        took = closed_after(sock, t0, HEADER_S + 5)
    assert HEADER_S * 0.9 < took < HEADER_S + 1.5, took


@pytest.mark.timeout(30)
def test_head_trickled_byte_by_byte_is_closed_after_header_timeout(bounded):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000
    with _connect(bounded.url) as sock:
        sock.settimeout(0.1)
        t0 = time.monotonic()
        closed_after = None
        for i in range(len(head)):
            try:
                sock.sendall(head[i : i + 1])
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - t0
                break
            if time.monotonic() - t0 > HEADER_S + 5:
                break
    assert closed_after is not None and closed_after < HEADER_S + 1.5, closed_after


@pytest.mark.timeout(30)
def test_partial_body_gets_408_after_body_timeout_and_charges_nothing(bounded):
    key = bounded.tenant("slowbody", tokens_per_day=BIG, max_concurrent=2)
    minute0 = this_minute()
    body = json.dumps(BODY).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with _connect(bounded.url) as sock:
        t0 = time.monotonic()
        sock.sendall(head + body[:10])
        sock.settimeout(BODY_S + 5)
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(4096)
            assert chunk, f"closed without an answer: {raw!r}"
            raw += chunk
        took = time.monotonic() - t0
        status_line, rest = raw.split(b"\r\n", 1)
        headers, payload = rest.split(b"\r\n\r\n", 1)
        length = int(
            next(
                h.split(b":")[1]
                for h in headers.split(b"\r\n")
                if h.lower().startswith(b"content-length")
            )
        )
        while len(payload) < length:
            payload += sock.recv(4096)
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    err = json.loads(payload)["error"]
    assert err["code"] == "timeout" and err["message"] and "type" in err and "param" in err
    assert BODY_S * 0.9 < took < BODY_S + 1.5, took
    assert_books(bounded.url, key, 0, minute0)


@pytest.mark.timeout(30)
def test_idle_keep_alive_connection_is_closed_after_keep_alive_timeout(bounded):
    with _connect(bounded.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while not raw.endswith(b"}"):  # {"status":"ok"}
            chunk = sock.recv(4096)
            assert chunk, raw
            raw += chunk
        t0 = time.monotonic()
        assert raw.startswith(b"HTTP/1.1 200")
        took = closed_after(sock, t0, HEADER_S + 5)
    # Closed by the keep-alive timer, before the (longer) head timer would have.
    assert KEEP_ALIVE_S * 0.8 < took < HEADER_S * 0.95, took


# -- 8. The client's deadline --------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("heartbeat_s", [0.3, 5.0], ids=["committed", "uncommitted"])
def test_client_deadline_on_a_hung_worker_answers_in_time(redis_url, heartbeat_s):
    """`x-request-timeout: 1` to a worker that never answers: a non-streaming request gets
    408 request_timeout (the client's own budget ran out; no Retry-After) within ~2 s; a
    stream gets an in-band request_timeout error (committed after one heartbeat) or a real
    408 (deadline before the first heartbeat). Nothing is charged and the slot is free; the
    worker sees the requests abandoned."""
    with gateway_stack(redis_url, replicas={"small": 1}, sse_heartbeat_s=heartbeat_s) as s:
        backend = s.backends["small0"]
        key = s.tenant("deadline", tokens_per_day=BIG, max_concurrent=4)
        minute0 = this_minute()
        backend.mode = "hang"
        deadline = {"x-request-timeout": "1"}
        plain = send(s.url, key, BODY, headers=deadline, timeout_s=10)
        assert plain.status == 408 and plain.code == "request_timeout", (plain.status, plain.body)
        assert "retry-after" not in plain.headers
        streamed = send(s.url, key, stream_body(), headers=deadline, timeout_s=10)
        if heartbeat_s < 1:
            assert streamed.status == 200 and streamed.comments >= 1
            assert streamed.code == "request_timeout" and streamed.done, streamed.events
        else:
            assert streamed.status == 408 and streamed.code == "request_timeout"
        for r in (plain, streamed):
            assert 0.9 < r.elapsed_s < 2.0, r.elapsed_s
        wait_until(lambda: backend.active == 0, 5, "the worker saw both abandoned")
        assert_books(s.url, key, 0, minute0)


@pytest.mark.timeout(30)
def test_invalid_deadline_headers_are_400_and_charge_nothing(stack):
    key = stack.tenant("baddeadline", tokens_per_day=BIG, max_concurrent=4)
    for value in ["nan", "-1", "0", "inf", "-inf", "1e999", "abc", ""]:
        for body in (BODY, stream_body()):
            r = send(stack.url, key, body, headers={"x-request-timeout": value}, timeout_s=5)
            assert r.status == 400, (value, r.status, r.body)
            assert r.body["error"]["param"] == "x-request-timeout", r.body
    assert len(stack.backends["small0"].bodies) == 0
    u = usage(stack.url, key)
    assert (u["tokens_today"], u["requests_this_minute"], u["concurrent_requests"]) == (0, 0, 0)
