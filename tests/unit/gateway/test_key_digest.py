"""A bearer key is hashed once per request: the door leaves its digest in the ASGI scope and
authentication takes it from there; without a door in front, authentication hashes it with
the same function."""

import asyncio
import random
import time
from types import SimpleNamespace

import pytest
from litestar import Request

from gateway.capacity import door
from gateway.capacity.door import KEY_DIGEST, Gate, door_middleware, key_digest
from gateway.config import GatewayConfig
from gateway.serving.intake import authenticate_caller

KEY = b"sk-test-key"
TENANT = SimpleNamespace(tenant_id="acme")
CALLER = ("k1", TENANT, None)


@pytest.fixture
def hashes(monkeypatch) -> list[bytes]:
    """Every key the door's `key_digest` hashes, whoever calls it."""
    seen: list[bytes] = []
    real = door.hashlib.blake2b

    def blake2b(data: bytes, **kw):  # noqa: ANN003, ANN202
        seen.append(data)
        return real(data, **kw)

    monkeypatch.setattr(door, "hashlib", SimpleNamespace(blake2b=blake2b))
    return seen


def gateway(known: dict[bytes, str]) -> SimpleNamespace:
    """A gateway whose key cache knows these keys (plaintext -> key id), and whose Redis
    lookups fail the test."""

    async def authenticate(plaintext: str) -> object:
        raise AssertionError(f"looked up {plaintext!r} in Redis")

    now = time.monotonic()
    return SimpleNamespace(
        config=GatewayConfig(pools={"small": ["http://w"]}),
        known_keys={
            key_digest(b"Bearer " + k): ((key_id, TENANT, None), now) for k, key_id in known.items()
        },
        keys_changed_at=0.0,
        key_lookups={},
        store=SimpleNamespace(authenticate=authenticate),
        metrics=None,
        rng=random.Random(0),
    )


def http_scope(key: bytes) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer " + key)],
    }


def test_behind_the_door_a_request_hashes_its_key_once(hashes) -> None:
    gw = gateway({KEY: "k1"})
    hashes.clear()
    callers = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        callers.append(await authenticate_caller(gw, Request(scope, receive, send)))

    def tenant_of(digest: bytes) -> str | None:
        known = gw.known_keys.get(digest)
        return known[0][1].tenant_id if known is not None else None

    async def main() -> None:
        guarded = door_middleware(app, Gate(), tenant_of)
        for _ in range(3):
            await guarded(http_scope(KEY), None, None)

    asyncio.run(main())
    assert callers == [CALLER] * 3
    assert hashes == [KEY] * 3  # the door's, one a request; authentication hashed nothing


def test_authentication_takes_the_digest_the_door_left_in_the_scope(hashes) -> None:
    gw = gateway({KEY: "k1", b"sk-other-key": "k2"})
    # The header names another key: authentication believes the door's digest, not the header.
    request = Request({**http_scope(b"sk-other-key"), KEY_DIGEST: key_digest(b"Bearer " + KEY)})
    hashes.clear()
    assert asyncio.run(authenticate_caller(gw, request)) == CALLER
    assert hashes == []


def test_without_a_door_authentication_hashes_the_key_itself(hashes) -> None:
    gw = gateway({KEY: "k1"})
    hashes.clear()
    assert asyncio.run(authenticate_caller(gw, Request(http_scope(KEY)))) == CALLER
    assert hashes == [KEY]


def test_only_a_bearer_key_has_a_digest() -> None:
    assert key_digest(b"Basic dXNlcjpwYXNz") is None
    assert key_digest(b"bearer  " + KEY + b" ") == key_digest(b"Bearer " + KEY)
