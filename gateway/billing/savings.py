"""What an `auto` request would have cost on each pool of the cascade: the tokens its answer
was billed (prompt, cached, completion), at the large pool's price and at the small pool's,
beside what it did cost (an escalated request: both attempts). A compute-priced pool is
reckoned at the seconds a token has cost there lately (`PriceBook.compute_per_token_s`).
It is an estimate: another model's answer would not have had the same length."""

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.billing.prices import PoolPrice, Tokens, cost_nanos
from quota.usage import AutoCost
from workers.api.types import Usage

if TYPE_CHECKING:
    from gateway.gateway import Gateway


def auto_cost(
    gw: "Gateway", prices: Mapping[str, PoolPrice], answer: Usage, cost: int, route: str
) -> AutoCost | None:
    """None without a cascade."""
    router = gw.router
    if router is None:
        return None
    details = answer.prompt_tokens_details
    used = Tokens(
        answer.prompt_tokens,
        details.cached_tokens if details is not None else 0,
        answer.completion_tokens,
    )

    def on(pool: str) -> int:
        return cost_nanos(prices.get(pool), used, gw.prices.compute_per_token_s(pool))

    return AutoCost(
        cost_nanos=cost,
        if_large_nanos=on(router.large_pool),
        if_small_nanos=on(router.small_pool),
        escalated=route == "escalated",
        overflowed=route == "overflow",
    )
