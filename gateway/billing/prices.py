"""What a pool charges, and what a request costs there: pure arithmetic over plain data.

A pool is priced either by tokens (per million prompt, cached prompt and completion tokens,
as a provider bills) or by compute-seconds (its workers report each request's share of the
engine time of every step it was in, `workers.api.types.ComputeSeconds`). Money is integer
nanos of the gateway's currency (`quota.budget.NANOS`), each request's cost rounded once,
so the sum of what clients are told is exactly what their tenants are charged.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta

from quota.budget import NANOS

Money = Annotated[float, Meta(ge=0.0, le=1e6)]  # per million tokens, or per second
PerToken = Annotated[float, Meta(gt=0.0, le=3600.0)]


class PoolPrice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`pools.NAME.price` in serve.yaml, and one pool's entry of `PUT /admin/prices`.

    By tokens: `prompt_per_mtok`, `cached_per_mtok` (None: the prompt price) and
    `completion_per_mtok`, per million tokens. By compute: `per_compute_s` set, the tokens'
    prices are not used; a request reserves `reserve_compute_s_per_token` seconds for each
    token it may use (prompt + n x max_tokens) before it runs, its worst case, and settles
    at the seconds its workers report.
    """

    prompt_per_mtok: Money = 0.0
    cached_per_mtok: Money | None = None
    completion_per_mtok: Money = 0.0
    per_compute_s: Money | None = None
    reserve_compute_s_per_token: PerToken = 0.05

    @property
    def by_compute(self) -> bool:
        return self.per_compute_s is not None


@dataclass(frozen=True)
class Tokens:
    """What one attempt used, as billed (clamped) by the gateway."""

    prompt: int
    cached: int
    completion: int
    compute_s: float | None = None  # the workers' engine seconds (None: not reported)


def _nanos(amount: float) -> int:
    return int(round(amount * NANOS))


def token_cost_nanos(price: PoolPrice, prompt: int, cached: int, completion: int) -> int:
    cached = min(max(0, cached), prompt)
    cached_price = price.prompt_per_mtok if price.cached_per_mtok is None else price.cached_per_mtok
    per_mtok = (
        (prompt - cached) * price.prompt_per_mtok
        + cached * cached_price
        + completion * price.completion_per_mtok
    )
    return _nanos(per_mtok / 1e6)


def cost_nanos(price: PoolPrice | None, used: Tokens, compute_per_token_s: float) -> int:
    """What `used` costs at `price` (None: unpriced, 0). A compute-priced attempt whose
    workers reported no seconds (a cut stream, a foreign server) is priced at
    `compute_per_token_s` per token: the seconds a token has cost on that pool."""
    if price is None:
        return 0
    if price.per_compute_s is None:
        return token_cost_nanos(price, used.prompt, used.cached, used.completion)
    seconds = used.compute_s
    if seconds is None:
        seconds = (used.prompt + used.completion) * compute_per_token_s
    return _nanos(seconds * price.per_compute_s)


def worst_case_nanos(price: PoolPrice | None, prompt: int, max_tokens: int, n: int = 1) -> int:
    """What a request may cost at most on a pool before it runs (what is reserved): every
    prompt token uncached and every sample at max_tokens; for a compute price, the pool's
    reserved seconds per token."""
    if price is None:
        return 0
    if price.per_compute_s is None:
        return token_cost_nanos(price, prompt, 0, n * max_tokens)
    seconds = (prompt + n * max_tokens) * price.reserve_compute_s_per_token
    return _nanos(seconds * price.per_compute_s)


def prices_from_dict(raw: object, pools: Mapping[str, str]) -> dict[str, PoolPrice]:
    """`{pool: {price fields}}` checked strictly: unknown pools and fields, negative or
    non-numeric prices, and a compute price on a pool whose servers report no
    compute-seconds (`pools`: name -> kind) are ValueError naming `pools.<name>...`."""
    if not isinstance(raw, dict):
        raise ValueError("prices must be an object of pool name -> price")
    out: dict[str, PoolPrice] = {}
    for name, doc in raw.items():
        if name not in pools:
            known = ", ".join(sorted(pools))
            raise ValueError(f"pools.{name}: no such pool (pools: {known})")
        try:
            price = msgspec.convert(doc, PoolPrice, strict=True)
        except msgspec.ValidationError as exc:
            raise ValueError(f"pools.{name}.price: {exc}") from None
        if price.per_compute_s is not None and pools[name] != "switchyard":
            raise ValueError(
                f"pools.{name}.price.per_compute_s: a {pools[name]} pool reports no "
                "compute-seconds; price it by tokens, as its provider bills"
            )
        out[name] = price
    return out


def prices_to_dict(prices: Mapping[str, PoolPrice]) -> dict[str, dict]:
    return {name: msgspec.to_builtins(p) for name, p in sorted(prices.items())}
