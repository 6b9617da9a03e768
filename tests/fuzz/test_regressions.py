"""Bugs the fuzz found, one focused reproducer each, against the real stack of
tests/fuzz/conftest.py. A known bug is a strict xfail: once fixed, the test passes, pytest
reports XPASS as a failure, and the xfail and its entry in `harness.KNOWN_ISSUES` go."""

import httpx
import pytest


@pytest.mark.xfail(
    strict=True,
    reason="known bug: an x-request-timeout the request cannot meet, on an idle gateway, is "
    "answered 503 deadline_exceeded with Retry-After, the answer reserved for overload",
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_deadline_too_short_is_not_answered_as_overload(gateway, stream):
    url, keys = gateway
    body = {"model": "small", "prompt": "hello", "max_tokens": 2, "stream": stream}
    headers = {"authorization": f"Bearer {keys['counted']}", "x-request-timeout": "0.0001"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=20)
    assert r.status_code != 503 and "retry-after" not in r.headers, (r.status_code, r.text)
