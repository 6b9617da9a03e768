"""Fair share between tenants at a real worker over HTTP: with one tenant's long prompts
queued for many engine steps, another tenant's short request gets its first token within a
few steps of arriving, instead of after the whole queue. The tenant is the request's cache
salt, which the gateway sets per tenant."""

import asyncio
import json
import time

import httpx

from tests.support.waiting import eventually
from tests.support.worker import running_worker
from tests.support.worker_client import load

HEAVY = 16  # requests
HEAVY_PROMPT = 1200  # tokens each: ~38 steps of the test worker's 512-token budget


def _body(tenant: str, prompt: list[int]) -> dict:
    return {
        "model": "small",
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "cache_salt": tenant,
    }


async def _first_token_at(client: httpx.AsyncClient, body: dict) -> float:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.monotonic()
    raise AssertionError("the stream ended without a token")


def test_a_light_tenant_is_not_queued_behind_a_heavy_tenants_long_prompts(demo_dir):
    with running_worker(demo_dir, num_kv_blocks=2048, max_num_seqs=64) as worker:

        async def run() -> tuple[list[float], float]:
            async with httpx.AsyncClient(base_url=worker.url, timeout=120) as client:
                heavy = [
                    asyncio.create_task(
                        _first_token_at(
                            client,
                            _body(
                                "heavy",
                                [10 + i] + [(i * 7 + j) % 900 + 10 for j in range(HEAVY_PROMPT)],
                            ),
                        )
                    )
                    for i in range(HEAVY)
                ]
                queued = lambda: sum(load(worker.url)[k] for k in ("num_waiting", "num_running"))  # noqa: E731
                assert await asyncio.to_thread(eventually, lambda: queued() == HEAVY, 60)
                light = await _first_token_at(client, _body("light", list(range(10, 26))))
                return list(await asyncio.gather(*heavy)), light

        heavy_first, light_first = asyncio.run(run())
    ahead = sum(t < light_first for t in heavy_first)
    # One tenant's queue at a time (first in, first out), the light request would come
    # after all 16; sharing each step's budget, it comes after a few.
    assert ahead <= HEAVY // 2, f"{ahead} of the heavy tenant's requests went first"
