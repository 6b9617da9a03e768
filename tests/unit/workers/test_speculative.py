"""Speculative decoding's pure parts: the n-gram proposer, who may speculate and how far,
the accept rule, and the scheduler's verify chunks and rewind (no torch)."""

import subprocess
import sys

import pytest

from tests.unit.workers.scheduler_factories import REPO_ROOT, make_request, make_scheduler
from workers.engine.config import SpeculativeConfig
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculative import (
    accept_drafts,
    num_speculative_tokens,
    propose_ngram,
    token_bytes,
)
from workers.errors import InvalidRequestError

NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, min_ngram=1, max_ngram=3)

# -- the proposer ------------------------------------------------------------------------


def test_speculative_module_imports_without_torch() -> None:
    code = "import sys, workers.engine.speculative; assert 'torch' not in sys.modules"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_proposal_copies_what_followed_the_suffix_earlier() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 6]


def test_proposal_stops_at_the_end_of_what_followed_when_it_cannot_repeat() -> None:
    # The suffix [8, 5] recurs at 1..2, followed by [6, 8, 5]: the copy runs on into the
    # suffix itself (an overlapping copy), so it repeats the period [6, 8, 5].
    assert propose_ngram([0, 8, 5, 6, 8, 5], 5, 1, 3) == [6, 8, 5, 6, 8]


def test_a_loop_of_one_token_proposes_more_of_it() -> None:
    assert propose_ngram([4, 9, 9, 9], 4, 1, 3) == [9, 9, 9, 9]


def test_the_longest_recurring_suffix_wins_over_a_later_shorter_match() -> None:
    # Suffix [1, 2, 3]: it recurs at 0 (followed by 40); [2, 3] alone recurs later (50),
    # and [3] later still (60).
    tokens = [1, 2, 3, 40, 7, 2, 3, 50, 3, 60, 1, 2, 3]
    assert propose_ngram(tokens, 1, 1, 3) == [40]
    assert propose_ngram(tokens, 1, 1, 2) == [50]
    assert propose_ngram(tokens, 1, 1, 1) == [60]


def test_of_several_occurrences_the_latest_is_copied() -> None:
    tokens = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6]
    assert propose_ngram(tokens, 2, 2, 2) == [20, 21]


def test_no_proposal_when_no_suffix_recurs_or_it_is_shorter_than_min_ngram() -> None:
    assert propose_ngram([1, 2, 3, 4, 5], 4, 1, 3) == []
    assert propose_ngram([1, 2, 9, 2], 4, 2, 3) == []  # only [2] recurs
    assert propose_ngram([7], 4, 1, 3) == []
    assert propose_ngram([1, 2, 1], 0, 1, 3) == []


def test_a_match_straddling_token_boundaries_in_the_bytes_is_not_taken() -> None:
    # Little-endian 4-byte ids: 0x01000000 then 0x05000000 are the bytes 00 00 00 01 00 00
    # 00 05, which hold token 1's bytes (01 00 00 00) at offset 3, not a token boundary.
    assert propose_ngram([0x0100_0000, 0x0500_0000, 5, 1], 2, 1, 1) == []
    assert propose_ngram([1, 8, 0x0100_0000, 0x0500_0000, 1], 1, 1, 1) == [8]


def test_proposals_agree_with_a_naive_search() -> None:
    import random

    def naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    seq = list(tokens)
                    at = start + n
                    out = []
                    for i in range(k):
                        out.append(seq[at + i] if at + i < len(seq) else out[at + i - len(seq)])
                    return out
        return []

    rng = random.Random(0)
    for _ in range(2_000):
        tokens = [rng.randrange(6) * 257 for _ in range(rng.randint(1, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        assert propose_ngram(tokens, k, lo, hi) == naive(tokens, k, lo, hi), tokens


def test_a_kept_haystack_extended_step_by_step_proposes_as_a_fresh_one() -> None:
    import random

    rng = random.Random(1)
    tokens: list[int] = []
    kept = None
    for _ in range(300):
        tokens.append(rng.randrange(5))
        kept = token_bytes(tokens, kept)
        assert kept == token_bytes(tokens)
        assert propose_ngram(tokens, 3, 1, 3, kept) == propose_ngram(tokens, 3, 1, 3)


# -- who speculates, how far -----------------------------------------------------------


def _req(output: int = 0, max_tokens: int = 100, prompt: int = 10, **params) -> Request:
    req = Request(
        "r", list(range(prompt)), SamplingParams(max_tokens=max_tokens, **params), arrival_time=0
    )
    for t in range(output):
        req.append_token(t)
    return req


def test_a_request_speculates_the_pools_k_unless_it_asks_otherwise() -> None:
    assert num_speculative_tokens(_req(), NGRAM, 4096) == 4
    assert num_speculative_tokens(_req(num_speculative_tokens=2), NGRAM, 4096) == 2
    assert num_speculative_tokens(_req(num_speculative_tokens=9), NGRAM, 4096) == 4
    assert num_speculative_tokens(_req(num_speculative_tokens=0), NGRAM, 4096) == 0


def test_a_pool_without_speculation_or_off_by_default() -> None:
    off = SpeculativeConfig(method="none")
    assert num_speculative_tokens(_req(num_speculative_tokens=3), off, 4096) == 0
    opt_in = SpeculativeConfig(method="ngram", default_on=False)
    assert num_speculative_tokens(_req(), opt_in, 4096) == 0
    assert num_speculative_tokens(_req(num_speculative_tokens=3), opt_in, 4096) == 3


def test_drafts_never_reach_past_max_tokens_or_the_context() -> None:
    # 7 of 10 output tokens: the next token is the 8th, so 2 drafts at most.
    assert num_speculative_tokens(_req(output=7, max_tokens=10), NGRAM, 4096) == 2
    assert num_speculative_tokens(_req(output=9, max_tokens=10), NGRAM, 4096) == 0
    # 10 prompt + 3 output tokens: the last draft's position must stay below 15.
    assert num_speculative_tokens(_req(output=3), NGRAM, 15) == 2


def test_grammar_and_logprobs_requests_decode_without_speculation() -> None:
    assert num_speculative_tokens(_req(logprobs=0), NGRAM, 4096) == 0
    guided = _req()
    guided.guide = object()
    assert num_speculative_tokens(guided, NGRAM, 4096) == 0


def test_num_speculative_tokens_must_be_a_non_negative_integer() -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(num_speculative_tokens=-1)
    assert err.value.param == "num_speculative_tokens"


def test_speculative_config_is_validated() -> None:
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculativeConfig(min_ngram=3, max_ngram=2)


# -- the accept rule ---------------------------------------------------------------------


def test_accept_keeps_the_agreeing_prefix_and_the_targets_token_after_it() -> None:
    target = [5, 6, 70, 8, 9]
    asked: list[int] = []

    def choose(i: int) -> int:
        asked.append(i)
        return target[i]

    assert accept_drafts(choose, [5, 6, 7, 8]) == ([5, 6], 70)
    assert asked == [0, 1, 2]  # nothing drawn past the first disagreement


def test_accept_all_drafts_takes_the_bonus_token() -> None:
    assert accept_drafts([1, 2, 3].__getitem__, [1, 2]) == ([1, 2], 3)
    assert accept_drafts([4].__getitem__, []) == ([], 4)


# -- the scheduler: verify chunks and the rewind -----------------------------------------


def _decoding(sched, prompt: list[int], max_tokens: int = 50):
    req = make_request("a", prompt=prompt, max_tokens=max_tokens)
    sched.add(req)
    out = sched.schedule()
    sched.advance(out)
    req.append_token(prompt[0])
    return req


def test_a_decode_with_drafts_is_one_chunk_and_advances_only_past_what_is_kept() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    req = _decoding(sched, list(range(100, 106)))  # 6 prompt tokens, 1 output
    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.scheduled == [(req, 4)]
    assert req.num_draft_tokens(4) == 3
    sched.advance(out)
    assert req.num_computed_tokens == 7  # the last token only: drafts are not yet KV
    req.append_token(1)  # the first draft was kept
    sched.accept_draft(req)
    req.append_token(50)  # the target's own token instead of the second draft
    assert req.num_computed_tokens == 8 == req.num_tokens - 1


def test_no_block_holding_an_unverified_token_is_cached() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    prompt = list(range(200, 207))  # 7 tokens + 1 output = 8: two full blocks of 4
    req = _decoding(sched, prompt)
    req.spec_token_ids = [11, 12, 13, 14]  # would fill a third block
    out = sched.schedule()
    sched.advance(out)
    req.append_token(99)  # all drafts rejected
    assert sched.kv._num_registered["a"] == 2  # the third block is not registered
    # A later request with the rejected drafts in the same positions hits two blocks only.
    other = make_request("b", prompt=prompt + [prompt[0], 11, 12, 13, 14, 1])
    assert sched.kv.get_computed_blocks(other)[1] == 8


def test_drafts_fit_the_budget_and_never_crowd_out_another_decode() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    a = make_request("a", prompt=[1, 2, 3], max_tokens=50)
    b = make_request("b", prompt=[4, 5, 6], max_tokens=50)
    sched.add(a)
    sched.add(b)
    sched.advance(sched.schedule())
    a.append_token(9)
    b.append_token(9)
    a.spec_token_ids = [1, 2, 3, 4, 5]
    b.spec_token_ids = [1, 2]
    out = sched.schedule()
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"a": 5, "b": 1}
    assert a.spec_token_ids == [1, 2, 3, 4] and b.spec_token_ids == []


def test_drafts_whose_kv_does_not_fit_are_dropped_rather_than_preempting() -> None:
    # 3 blocks of 4: a holds 2 (7 tokens); b holds 1. 4 drafts would need a 4th block.
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    a = make_request("a", prompt=list(range(10, 16)), max_tokens=50)
    b = make_request("b", prompt=[1, 2], max_tokens=50)
    sched.add(a)
    sched.add(b)
    sched.advance(sched.schedule())
    a.append_token(9)
    b.append_token(9)
    a.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert a.spec_token_ids == [] and not out.preempted


def test_a_preempted_request_loses_its_drafts() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    req = _decoding(sched, [1, 2, 3])
    req.spec_token_ids = [4, 5]
    sched._preempt(req)
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0


def test_the_worker_api_field_reaches_the_sampling_params() -> None:
    from workers.api.types import CompletionRequest
    from workers.server.openai_format import sampling_params

    req = CompletionRequest(model="m", prompt="hi", num_speculative_tokens=2)
    assert sampling_params(req, 16).num_speculative_tokens == 2
    assert (
        sampling_params(CompletionRequest(model="m", prompt="hi"), 16).num_speculative_tokens
        is None
    )
