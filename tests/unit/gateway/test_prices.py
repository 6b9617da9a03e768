"""Prices as arithmetic: tokens by kind, compute-seconds, worst cases, what is refused."""

import pytest

from gateway.billing.budgets import plan_worst_case_nanos
from gateway.billing.prices import PoolPrice, Tokens, cost_nanos, prices_from_dict, worst_case_nanos

TOKENS = PoolPrice(prompt_per_mtok=1.0, cached_per_mtok=0.25, completion_per_mtok=4.0)
COMPUTE = PoolPrice(per_compute_s=0.5, reserve_compute_s_per_token=0.01)


def test_cached_prompt_tokens_are_priced_at_the_cached_price() -> None:
    # 1000 prompt tokens of which 400 cached, 100 completion: 600 x 1 + 400 x 0.25 + 100 x 4
    # per million = 0.0011 units = 1,100,000 nanos.
    assert cost_nanos(TOKENS, Tokens(1000, 400, 100), 0.0) == 1_100_000
    assert cost_nanos(TOKENS, Tokens(1000, 0, 100), 0.0) == 1_400_000
    no_cached_price = PoolPrice(prompt_per_mtok=1.0, completion_per_mtok=4.0)
    assert cost_nanos(no_cached_price, Tokens(1000, 400, 100), 0.0) == 1_400_000
    assert cost_nanos(TOKENS, Tokens(10, 50, 0), 0.0) == cost_nanos(TOKENS, Tokens(10, 10, 0), 0.0)
    assert cost_nanos(None, Tokens(1000, 0, 100), 0.0) == 0


def test_a_compute_price_charges_the_reported_seconds_else_the_pools_rate() -> None:
    assert cost_nanos(COMPUTE, Tokens(100, 0, 20, compute_s=0.2), 0.0) == 100_000_000
    assert cost_nanos(COMPUTE, Tokens(100, 0, 20), 0.001) == 60_000_000  # 120 x 1 ms x 0.5


def test_the_worst_case_is_every_token_uncached_and_every_sample_at_max_tokens() -> None:
    assert worst_case_nanos(TOKENS, 1000, 100, n=2) == 1_800_000
    assert worst_case_nanos(COMPUTE, 100, 20, n=1) == 600_000_000  # 120 x 10 ms x 0.5
    assert worst_case_nanos(TOKENS, 10**6, 10**4) >= cost_nanos(TOKENS, Tokens(10**6, 9, 10**4), 0)
    both = plan_worst_case_nanos({"s": TOKENS, "l": TOKENS}, "s", 1000, 100, 1, "l")
    assert both == 2 * worst_case_nanos(TOKENS, 1000, 100)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"nope": {}}, "pools.nope"),
        ({"small": {"prompt_per_mtok": -1}}, "pools.small.price"),
        ({"small": {"prompt_per_mtok": "1"}}, "pools.small.price"),
        ({"small": {"per_token": 1}}, "pools.small.price"),
        ({"remote": {"per_compute_s": 1.0}}, "pools.remote.price.per_compute_s"),
        ([], "prices must be"),
    ],
)
def test_a_bad_price_list_is_refused_naming_the_field(raw: object, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        prices_from_dict(raw, {"small": "switchyard", "remote": "openai"})


@pytest.mark.parametrize(
    "answer",
    [
        b'{"id":"x","choices":[{"text":"\\"usage\\": {fake}"}],"usage":{"prompt_tokens":4}}',
        b'{"usage": {"prompt_tokens": 4, "completion_tokens": 2}, "id": "x"}',
        b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":0,"total_tokens":1}}',
    ],
)
def test_the_cost_is_spliced_into_the_usage_object_and_the_json_stays_valid(answer: bytes) -> None:
    import json

    from gateway.serving.plan import with_usage_cost

    out = with_usage_cost(answer, 0.000123)
    assert out is not None
    doc, before = json.loads(out), json.loads(answer)
    assert doc["usage"] == {"cost": 0.000123, **before["usage"]}
    assert {k: v for k, v in doc.items() if k != "usage"} == {
        k: v for k, v in before.items() if k != "usage"
    }


@pytest.mark.parametrize(
    "answer",
    [b'{"usage":null}', b'{"usage":{}}', b'{"a":{"usage":{"x":1}},"usage":{"y":1}}', b"{}"],
)
def test_what_cannot_be_spliced_safely_is_left_to_the_decoder(answer: bytes) -> None:
    from gateway.serving.plan import with_usage_cost

    assert with_usage_cost(answer, 1.0) is None
