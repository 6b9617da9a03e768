"""The verify step's sampling rule against exact probabilities: with drafts, each emitted
token is distributed as the target's filtered distribution after the tokens before it
(accept a draft t with probability p(t); on rejection, p without t, renormalised)."""

import torch

from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.runner.sampler import (
    argmax_rows,
    draw_row,
    make_sampling_batch,
    sample,
    target_distribution,
)
from workers.runner.verify import verify_drafts

# Chi-square quantiles at 0.999 (a correct rule fails one run in a thousand; the draws are
# seeded, so the test is deterministic).
CHI2_999 = {3: 16.266, 5: 20.515}


def _chi2(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True) if p)


def _exact(logits: torch.Tensor, temperature: float, top_k: int) -> list[float]:
    """softmax(logits / T) over the top-k tokens, by hand."""
    scaled = logits / temperature
    kept = scaled.topk(top_k).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[kept] = scaled[kept]
    return masked.softmax(-1).tolist()


def _request(seed: int, **params) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(seed=seed, **params), arrival_time=0.0)
    req.generator = torch.Generator().manual_seed(seed)
    return req


def test_each_emitted_token_follows_the_target_distribution() -> None:
    # Three positions over a vocabulary of 8, top-k 6 (two tokens never drawn): drafts
    # [1, 4]; token 1 is likely (accepted often), token 4 less so.
    logits = torch.tensor(
        [
            [0.3, 1.6, 0.1, -0.4, 0.8, -2.0, 0.5, 0.0],
            [0.2, -0.3, 0.9, 0.1, 0.6, 0.4, -1.5, 0.0],
            [1.1, 0.0, -0.2, 0.7, 0.3, -0.9, 0.2, 0.5],
        ]
    )
    temperature, top_k, drafts = 0.8, 6, [1, 4]
    exact = [_exact(row, temperature, top_k) for row in logits]
    first = [0] * 8
    second = [0] * 8  # given the first draft kept
    third = [0] * 8  # given both kept
    num_draws = 12_000
    reqs = [_request(seed, temperature=temperature, top_k=top_k) for seed in range(num_draws)]
    verdicts = verify_drafts(
        logits.repeat(num_draws, 1), reqs, [drafts] * num_draws, torch.device("cpu"), argmax_rows
    )
    for kept, token in verdicts:
        emitted = [*kept, token]
        assert kept == drafts[: len(kept)]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        if len(emitted) > 2:
            third[emitted[2]] += 1
    for counts, probs in ((first, exact[0]), (second, exact[1]), (third, exact[2])):
        assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
        assert _chi2(counts, probs) < CHI2_999[5], (counts, probs)
    # The drafts are kept as often as the rule says: p(1), then p(1) p(4).
    assert abs(sum(second) / num_draws - exact[0][1]) < 0.02
    assert abs(sum(third) / num_draws - exact[0][1] * exact[1][4]) < 0.02


def test_a_rejected_draft_is_never_emitted_in_its_place() -> None:
    # Token 0 is the draft; when it is refused, what comes instead is p without token 0.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    exact = logits[0].softmax(-1).tolist()
    residual = [0.0] + [p / (1 - exact[0]) for p in exact[1:]]
    counts = [0] * 4
    num_draws = 6_000
    reqs = [_request(seed, temperature=1.0) for seed in range(num_draws)]
    verdicts = verify_drafts(
        logits.repeat(num_draws, 1), reqs, [[0]] * num_draws, torch.device("cpu"), argmax_rows
    )
    for kept, token in verdicts:
        if not kept:
            counts[token] += 1
    assert counts[0] == 0
    assert _chi2(counts, residual) < CHI2_999[3]


def test_a_verify_row_draws_what_plain_sampling_draws_from_the_same_generator() -> None:
    logits = torch.randn(1, 64)
    params = SamplingParams(temperature=0.9, top_p=0.8)
    for seed in range(20):
        plain = Request("p", [1], params, arrival_time=0.0)
        plain.generator = torch.Generator().manual_seed(seed)
        batch = make_sampling_batch([plain], torch.device("cpu"))
        token = sample(logits, batch).item()
        gen = torch.Generator().manual_seed(seed)
        _, probs = target_distribution(logits, batch, argmax_rows)
        assert probs is not None
        assert draw_row(probs[0], gen, argmax_rows) == token
        # Both drew one row: the generators are in the same state.
        assert torch.equal(gen.get_state(), plain.generator.get_state())


def test_min_tokens_masks_eos_at_the_positions_still_below_it() -> None:
    # Output has 2 tokens, min_tokens 4: rows 0 and 1 of the chunk (output tokens 3 and 4)
    # may not be EOS (2); row 2 (token 5) may. Every row's greedy choice is EOS.
    logits = torch.tensor([[0.0, 0.0, 9.0, 1.0]] * 3)
    req = Request(
        "r",
        [1, 2, 3],
        SamplingParams(temperature=0.0, min_tokens=4),
        arrival_time=0.0,
        eos_token_ids=(2,),
    )
    req.append_token(3)
    req.append_token(3)
    [(kept, token)] = verify_drafts(logits, [req], [[3, 3]], torch.device("cpu"), argmax_rows)
    assert (kept, token) == ([3, 3], 2)
