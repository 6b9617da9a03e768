"""One request's failure inside the engine is that request's alone (real tiny model).

Each test runs a batch with one request that makes the engine raise (a hook, or an
out-of-range value that bypassed validation), and checks that the others produce exactly
what they produce without it, that the culprit ends with finish reason `error`, and that
every KV block is free afterwards.
"""

import pytest

from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import MAX_FAILED_STEPS, LLMEngine
from workers.engine.request import FinishReason
from workers.engine.sampling_params import SamplingParams
from workers.errors import EngineStepError

PROMPTS = ["The history of", "import os and sys", "A long time ago in"]


@pytest.fixture(scope="module")
def engine(demo_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(
        demo_dir,
        EngineConfig(
            num_kv_blocks=128,
            block_size=16,
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        ),
    )


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def seeded(i: int, n: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)


def run(engine: LLMEngine, requests) -> dict:
    """Run to completion; per request id: (token ids, finish reason, error)."""
    results = {r.request_id: ([], None, None) for r in requests}

    def record(out):
        ids, _, _ = results.get(out.request_id, ([], None, None))
        results[out.request_id] = (ids + out.new_token_ids, out.finish_reason, out.error)

    for r in requests:
        out = engine.add(r)
        if out is not None:
            record(out)
    while engine.has_unfinished_requests():
        for out in engine.step():
            record(out)
    return results


def good_requests(engine, params_of) -> list:
    return [
        engine.make_request(f"good-{i}", prompt=p, params=params_of(i))
        for i, p in enumerate(PROMPTS)
    ]


def assert_isolated(engine, perturbed: dict, reference: dict) -> None:
    for rid, (ids, reason, error) in reference.items():
        assert perturbed[rid] == (ids, reason, error), rid
    assert perturbed["bad"][1] is FinishReason.ERROR and perturbed["bad"][2]
    assert engine.kv.pool.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_a_request_whose_forward_pass_raises_mid_batch_fails_alone(engine, monkeypatch):
    reference = run(engine, good_requests(engine, lambda i: greedy()))
    original = engine.runner.execute
    batches_with_bad = []

    def execute(batch, tables):
        bad = [r for r, _ in batch if r.request_id == "bad"]
        if bad and bad[0].num_output_tokens >= 3:  # fails mid-generation, in a full batch
            batches_with_bad.append(len(batch))
            raise RuntimeError("boom: a kernel failed on this request")
        return original(batch, tables)

    monkeypatch.setattr(engine.runner, "execute", execute)
    failed_before = engine.num_failed_requests
    bad = engine.make_request("bad", prompt="the bad one", params=greedy())
    perturbed = run(engine, [*good_requests(engine, lambda i: greedy()), bad])
    assert_isolated(engine, perturbed, reference)
    assert "boom" in perturbed["bad"][2] and len(perturbed["bad"][0]) == 3
    assert batches_with_bad[0] == 4  # it failed inside the whole batch first
    assert engine.num_failed_requests == failed_before + 1


def bypassing(**fields) -> SamplingParams:
    """SamplingParams holding values that workers.api.validation would have refused."""
    params = greedy()
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**64, "temperature": 1.0},  # torch.Generator.manual_seed overflows
        {"top_k": 2**63, "temperature": 1.0},  # does not fit an int64 tensor
        {"stop_token_ids": [10**6], "min_tokens": 4},  # masks a logit beyond the vocabulary
        {"logprobs": 10**6},  # topk beyond the vocabulary
    ],
    ids=["seed", "top_k", "stop_token_ids", "logprobs"],
)
def test_out_of_range_values_that_slip_past_validation_fail_alone(engine, fields):
    reference = run(engine, good_requests(engine, seeded))
    bad = engine.make_request("bad", prompt="x", params=bypassing(**fields))
    perturbed = run(engine, [*good_requests(engine, seeded), bad])
    assert_isolated(engine, perturbed, reference)


def test_a_failure_after_sampling_leaves_seeded_neighbours_on_their_own_random_path(
    engine, monkeypatch
):
    import workers.runner.runner as runner_module

    reference = run(engine, good_requests(engine, seeded))
    original = runner_module.compute_logprobs
    current: list[str] = []
    original_execute = engine.runner.execute

    def execute(batch, tables):
        current[:] = [r.request_id for r, _ in batch]
        return original_execute(batch, tables)

    def compute_logprobs(*args, **kwargs):  # runs after every row drew its noise
        if "bad" in current:
            raise RuntimeError("logprobs failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    monkeypatch.setattr(runner_module, "compute_logprobs", compute_logprobs)
    goods = good_requests(engine, seeded)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    bad = engine.make_request("bad", prompt="late", params=params)
    for r in goods:
        engine.add(r)
    for _ in range(3):  # the seeded ones are mid-generation, their generators advanced
        engine.step()
    perturbed = run(engine, [bad])
    perturbed.update(
        {r.request_id: (list(r.output_token_ids), r.finish_reason, None) for r in goods}
    )
    assert_isolated(engine, perturbed, reference)


class ExplodingDetokenizer:
    def push(self, token_id: int, check_stops: bool = True) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    def delta(self, finished: bool) -> str:
        return ""


def test_a_request_failing_in_detokenization_fails_alone(engine):
    reference = run(engine, good_requests(engine, lambda i: greedy()))
    goods = good_requests(engine, lambda i: greedy())
    bad = engine.make_request("bad", prompt="the bad one", params=greedy())
    for r in [*goods, bad]:
        engine.add(r)
    engine._detok["bad"] = ExplodingDetokenizer()
    perturbed = run(engine, [])
    perturbed.update(
        {r.request_id: (list(r.output_token_ids), r.finish_reason, None) for r in goods}
    )
    perturbed["bad"] = (list(bad.output_token_ids), bad.finish_reason, "failed")
    assert_isolated(engine, perturbed, reference)
    assert engine.num_failed_requests >= 1


def test_a_request_failing_at_add_fails_alone_and_its_twin_id_is_untouched(engine, monkeypatch):
    first = engine.make_request("twin", prompt="The history of", params=greedy(6))
    second = engine.make_request("twin", prompt="another", params=greedy(6))
    assert engine.add(first) is None
    refused = engine.add(second)  # a duplicate id: refused, the first keeps running
    assert refused is not None and refused.finish_reason is FinishReason.ERROR
    assert "duplicate" in refused.error
    run(engine, [])
    assert first.finish_reason is FinishReason.LENGTH and first.num_output_tokens == 6

    import workers.engine.llm_engine as engine_module

    real = engine_module.IncrementalDetokenizer

    def detokenizer(tok, prompt_ids, stop, skip):
        if stop == ["poison"]:
            raise ValueError("cannot build the detokenizer")
        return real(tok, prompt_ids, stop, skip)

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", detokenizer)
    params = SamplingParams(max_tokens=4, stop=["poison"])
    out = engine.add(engine.make_request("bad", prompt="x", params=params))
    assert out is not None and out.finished and out.finish_reason is FinishReason.ERROR
    assert not engine.has_unfinished_requests() and engine.kv.pool.num_used_blocks == 0


def test_a_failure_no_request_explains_stops_the_engine(engine, monkeypatch):
    def broken(batch, tables):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    # Several requests in one step, each failing alone: the device, not a request.
    for i in range(2):
        engine.add(engine.make_request(f"dev-{i}", prompt="hello", params=greedy(4)))
    with pytest.raises(EngineStepError, match="device lost"):
        engine.step()
    for i in range(2):
        engine.abort(f"dev-{i}")
    engine._num_failed_steps = 0  # a real engine is dead by now; this one is reused
    # One request per step: each is failed alone until MAX_FAILED_STEPS in a row.
    for i in range(MAX_FAILED_STEPS - 1):
        engine.add(engine.make_request(f"one-{i}", prompt="hello", params=greedy(4)))
        (out,) = engine.step()
        assert out.finish_reason is FinishReason.ERROR
    engine.add(engine.make_request("last", prompt="hello", params=greedy(4)))
    with pytest.raises(EngineStepError):
        engine.step()
    engine.abort("last")
    monkeypatch.undo()
    engine._num_failed_steps = 0
    assert engine.kv.pool.num_used_blocks == 0
