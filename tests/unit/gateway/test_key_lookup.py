"""A key whose cache entry aged is looked up in Redis once however many of its requests
arrive meanwhile; they all get that lookup's answer, and a caller that leaves does not
take it from the others."""

import asyncio
import random
from types import SimpleNamespace

from gateway.config import GatewayConfig
from gateway.serving.intake import authenticate_caller
from tests.support.waiting import settles
from workers.api.types import ApiError

REQUEST = SimpleNamespace(headers={"authorization": "Bearer sk-test-key"}, scope={})


def gateway(found: object) -> tuple[SimpleNamespace, list, asyncio.Event]:
    """A gateway whose key store answers `found` once `release` is set."""
    calls: list[str] = []
    release = asyncio.Event()

    async def authenticate(plaintext: str) -> object:
        calls.append(plaintext)
        await release.wait()
        return found

    gw = SimpleNamespace(
        config=GatewayConfig(pools={"small": ["http://w"]}),
        known_keys={},
        keys_changed_at=0.0,
        key_lookups=Lookups(),
        store=SimpleNamespace(authenticate=authenticate),
        metrics=None,
        rng=random.Random(0),
    )
    return gw, calls, release


class Lookups(dict):
    """`Gateway.key_lookups` that counts the callers who asked it (each caller that misses
    the cache asks once, just before it joins or starts the lookup)."""

    asked = 0

    def get(self, *args):  # noqa: ANN002, ANN201
        self.asked += 1
        return super().get(*args)


def test_concurrent_misses_share_one_lookup() -> None:
    record = SimpleNamespace(key_id="k1", limits=None, budget=None)
    tenant = SimpleNamespace(tenant_id="acme")

    async def main() -> None:
        gw, calls, release = gateway((record, tenant))
        callers = [asyncio.ensure_future(authenticate_caller(gw, REQUEST)) for _ in range(10)]
        await settles(lambda: calls)  # the lookup has started
        await settles(lambda: gw.key_lookups.asked == 10)  # every caller joined it
        assert len(calls) == 1
        callers[0].cancel()  # the first caller leaves: the lookup goes on for the rest
        await settles(callers[0].done)
        release.set()
        results = await asyncio.gather(*callers[1:])
        assert results == [("k1", tenant, None)] * 9 and len(calls) == 1
        assert gw.key_lookups == {}
        assert await authenticate_caller(gw, REQUEST) == ("k1", tenant, None)  # cached
        assert len(calls) == 1

    asyncio.run(main())


def test_an_unknown_key_is_refused_to_every_waiting_caller() -> None:
    async def main() -> None:
        gw, calls, release = gateway(None)
        callers = [asyncio.ensure_future(authenticate_caller(gw, REQUEST)) for _ in range(5)]
        await settles(lambda: calls and gw.key_lookups.asked == 5)
        release.set()
        results = await asyncio.gather(*callers, return_exceptions=True)
        assert len(calls) == 1
        assert all(isinstance(r, ApiError) and r.status == 401 for r in results)
        assert gw.key_lookups == {}

    asyncio.run(main())


def test_an_aged_entry_is_looked_up_again() -> None:
    record = SimpleNamespace(key_id="k1", limits=None, budget=None)

    async def main() -> None:
        gw, calls, release = gateway((record, "tenant"))
        gw.config = GatewayConfig(pools={"small": ["http://w"]}, key_cache_ttl_s=0.0)
        release.set()
        for _ in range(3):
            await authenticate_caller(gw, REQUEST)
        assert len(calls) == 3

    asyncio.run(main())
