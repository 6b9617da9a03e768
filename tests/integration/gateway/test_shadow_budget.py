"""The shadow budget in a real Redis: one tenant cannot spend another's fair share, a
tenant alone can spend all of it, a light tenant's unused share goes to the others next
minute, concurrent takers through several clients (as from several gateways) never go past
the limit, and the script decides as the policy's pure functions do."""

import asyncio
import math
import random

from gateway.learning.shadow_budget import ShadowBudget, demands_of, fair_shares, may_take
from tests.integration.gateway.conftest import run_on_clients

RUN = 10  # tokens of one shadow run
LIMIT = 10 * RUN
T0 = 1_800_000_000.0  # the start of a minute


def _run(redis_url: str, body, num_clients: int = 1):  # noqa: ANN001, ANN202
    return run_on_clients(redis_url, ShadowBudget, body, num_clients)


async def _ask(budget: ShadowBudget, pattern: str, now_s: float) -> dict[str, int]:
    granted = {t: 0 for t in set(pattern)}
    for i, tenant in enumerate(pattern):
        if await budget.take(tenant, RUN, LIMIT, now_s + i * 0.01):
            granted[tenant] += 1
    return granted


def test_a_heavy_tenant_cannot_spend_the_share_of_one_that_asks_later(redis_url):
    # A asks four times for each of B's asks, and had the budget to itself for a moment.
    # Before the budget was shared, A got eight of the ten runs and B two.
    granted = _run(redis_url, lambda b: _ask(b, "AAAAB" * 10, T0))
    assert granted == {"A": 5, "B": 5}


def test_alone_a_tenant_can_spend_the_whole_budget(redis_url):
    assert _run(redis_url, lambda b: _ask(b, "A" * 15, T0)) == {"A": 10}


def test_a_light_tenant_leaves_its_unused_share_to_the_others_next_minute(redis_url):
    async def body(budget):  # noqa: ANN001, ANN202
        first = await _ask(budget, "A" * 12 + "B", T0)  # A spent it all before B came
        return first, await _ask(budget, "A" * 12 + "B", T0 + 60)

    first, second = _run(redis_url, body)
    assert first == {"A": 10, "B": 0}
    # B asked for one run last minute: that much is kept for it, the rest is A's.
    assert second == {"A": 9, "B": 1}


def test_takers_through_two_clients_at_once_share_the_budget_and_never_pass_it(redis_url):
    async def body(one, two):  # noqa: ANN001, ANN202
        takes = [(one, two)[i % 2].take(t, RUN, LIMIT, T0 + 1) for i, t in enumerate("AABB" * 20)]
        results = await asyncio.gather(*takes)
        return {
            t: sum(ok for ok, x in zip(results, "AABB" * 20, strict=True) if x == t) for t in "AB"
        }

    granted = _run(redis_url, body, num_clients=2)
    assert sum(granted.values()) == 10, granted  # all of it, and not a run more
    assert 4 <= granted["A"] <= 6 and 4 <= granted["B"] <= 6, granted


def _model_take(state: dict, tenant: str, tokens: int, limit: int, now_s: float) -> bool:
    """The policy's functions over plain dicts: what the script must decide."""
    minutes = now_s / 60
    minute = math.floor(minutes)
    asked = state.setdefault(("asked", minute), {})
    asked[tenant] = asked.get(tenant, 0) + tokens
    last = state.get(("asked", minute - 1), {})
    share = fair_shares(limit, demands_of(asked, last, 1.0 - (minutes - minute)))[tenant]
    used = state.setdefault(("used", minute), {})
    if not may_take(tokens, used.get(tenant, 0), share, sum(used.values()), limit):
        return False
    used[tenant] = used.get(tenant, 0) + tokens
    return True


def test_the_script_decides_as_the_policy_functions_do(redis_url):
    rng = random.Random(15)
    asks = []
    now_s = T0
    for _ in range(600):  # about three minutes, five tenants of different appetites
        now_s += rng.expovariate(3.0)
        tenant = rng.choices("abcde", weights=[8, 4, 2, 1, 1])[0]
        asks.append((tenant, rng.randint(1, 60), now_s))
    limit = 1000

    async def body(budget):  # noqa: ANN001, ANN202
        return [await budget.take(t, n, limit, at) for t, n, at in asks]

    got = _run(redis_url, body)
    state: dict = {}
    want = [_model_take(state, t, n, limit, at) for t, n, at in asks]
    assert got == want
    assert 0 < sum(got) < len(got)  # both answers were given
