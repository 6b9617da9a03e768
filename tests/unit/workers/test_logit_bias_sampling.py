"""logit_bias in sampling: added to each row's logits before anything else, per row, and
never reviving a token a mask has removed; refused by SamplingParams outside its bounds."""

import math

import pytest
import torch

from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.errors import InvalidRequestError
from workers.runner.sampler import apply_logit_bias, make_sampling_batch, sample


def make_req(rid: str = "r", output: int = 0, **params) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(**params), arrival_time=0.0, eos_token_ids=(2,))
    for _ in range(output):
        req.append_token(5)
    return req


def batch_of(*reqs: Request):
    return make_sampling_batch(list(reqs), torch.device("cpu"))


def test_each_rows_bias_is_added_to_its_own_tokens_only():
    logits = torch.zeros(3, 6)
    batch = batch_of(
        make_req("a", logit_bias={1: 2.5, 4: -100.0}),
        make_req("b"),
        make_req("c", logit_bias={0: 7.0}),
    )
    biased = apply_logit_bias(logits, batch)
    assert biased.tolist() == [
        [0.0, 2.5, 0.0, 0.0, -100.0, 0.0],
        [0.0] * 6,
        [7.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert logits.abs().sum().item() == 0  # the runner's logits are not modified


def test_without_any_bias_the_batch_carries_none_and_logits_pass_as_they_are():
    logits = torch.randn(2, 5)
    batch = batch_of(make_req("a"), make_req("b", temperature=0))
    assert batch.bias is None
    assert apply_logit_bias(logits, batch) is logits


def test_greedy_follows_the_bias_and_a_minus_100_bias_removes_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5]])
    assert sample(logits, batch_of(make_req(temperature=0, logit_bias={3: 2.6}))).item() == 3
    assert sample(logits, batch_of(make_req(temperature=0, logit_bias={1: -100.0}))).item() == 2


def test_a_plus_100_bias_wins_when_sampling_at_any_seed():
    logits = torch.randn(1, 50) * 3
    for seed in range(20):
        req = make_req(temperature=1.5, seed=seed, logit_bias={17: 100.0})
        req.generator = torch.Generator().manual_seed(seed)
        assert sample(logits, batch_of(req)).item() == 17


def test_a_bias_does_not_revive_a_token_min_tokens_masks():
    logits = torch.zeros(1, 4)
    # EOS (2) is banned until min_tokens are out; +100 on it must not bring it back.
    req = make_req(temperature=0, min_tokens=3, max_tokens=8, logit_bias={2: 100.0, 3: 1.0})
    assert sample(logits, batch_of(req)).item() == 3


@pytest.mark.parametrize(
    "bias",
    [{1: 100.5}, {1: -101.0}, {1: math.nan}, {1: math.inf}, {-1: 1.0}],
    ids=["over-100", "under-minus-100", "nan", "inf", "negative-id"],
)
def test_sampling_params_refuse_a_bias_out_of_bounds_naming_logit_bias(bias):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.param == "logit_bias"


def test_the_bounds_themselves_are_accepted():
    assert SamplingParams(logit_bias={0: -100.0, 5: 100.0}).logit_bias == {0: -100.0, 5: 100.0}
