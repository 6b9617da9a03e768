"""Sampling functions: filters, seeds, greedy rows, banned tokens, logprobs."""

import torch

from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.runner.sampler import compute_logprobs, make_sampling_batch, sample


def make_req(rid: str = "r", **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), arrival_time=0.0, eos_token_ids=(2,))


def batch_of(*reqs: Request):
    return make_sampling_batch(list(reqs), torch.device("cpu"))


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    tokens = sample(logits, batch_of(make_req(temperature=0), make_req(temperature=0)))
    assert tokens.tolist() == [1, 0]


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = torch.randn(4, 50)
    reqs = [make_req(f"r{i}", temperature=2.0, top_k=1) for i in range(4)]
    assert sample(logits, batch_of(*reqs)).tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    seen = {
        sample(logits, batch_of(make_req(temperature=1.0, top_p=0.7))).item() for _ in range(200)
    }
    assert seen <= {0, 1} and seen == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        sample(logits, batch_of(make_req(temperature=1.0, min_p=0.5))).item() for _ in range(200)
    }
    assert seen == {0, 1}


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 100)

    def draw(row_params, rows):
        req = make_req(temperature=1.0, seed=42, **row_params)
        req.generator = torch.Generator().manual_seed(42)
        others = [make_req(f"o{i}", temperature=1.0) for i in range(rows - 1)]
        return [sample(logits[:rows], batch_of(req, *others))[0].item() for _ in range(5)]

    assert draw({}, 1) == draw({}, 3)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 0.0]])
    req = make_req(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sample(logits, batch_of(req)).item() == 0
    req.append_token(0)
    req.append_token(0)
    assert sample(logits, batch_of(req)).item() == 2


def test_logprobs_are_the_raw_distribution_of_the_chosen_token_and_top_n():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    chosen, top_vals, top_ids = compute_logprobs(logits, torch.tensor([0]), 2)
    ref = logits.log_softmax(-1)[0]
    assert chosen.item() == ref[0].item()
    assert top_ids.tolist() == [[2, 1]]
    assert torch.allclose(top_vals[0], ref[[2, 1]])
