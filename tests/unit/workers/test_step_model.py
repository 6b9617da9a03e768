"""The step model learns what a step costs, and with an ITL target it bounds the batch:
the seats a decode step may hold, and the tokens a step carrying a prefill chunk may take."""

import random

import pytest

from tests.unit.workers.scheduler_factories import make_request, make_scheduler, step
from workers.engine.step_model import StepFit, StepModel, fit_steps

TRUE = StepFit(base_s=0.020, per_seq_s=0.001, per_token_s=0.0002, per_context_s=1e-6)


def observed(fit: StepFit, n: int, seed: int = 0) -> list[tuple[int, int, int, float]]:
    """Steps of varied sizes timed by `fit`, with 2% noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 32)
        tokens = seqs + rng.choice([0, 0, 64, 256, 512])
        context = seqs * rng.randint(10, 400)
        out.append(
            (seqs, tokens, context, fit.predict(seqs, tokens, context) * rng.uniform(0.98, 1.02))
        )
    return out


def test_the_fit_recovers_the_step_cost_of_each_part() -> None:
    fit = fit_steps(observed(TRUE, 200))
    assert fit is not None
    assert fit.base_s == pytest.approx(TRUE.base_s, rel=0.15)
    assert fit.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.1)
    for seqs, tokens, context in ((1, 1, 100), (32, 32, 6400), (8, 520, 2000)):
        assert fit.predict(seqs, tokens, context) == pytest.approx(
            TRUE.predict(seqs, tokens, context), rel=0.05
        )


def test_no_coefficient_is_negative_and_one_size_alone_fits_nothing() -> None:
    # Steps that only get faster with more tokens (noise) must not give a negative cost.
    samples = [(4, 4 + k, 40, 0.05 - k * 1e-6) for k in range(50)]
    fit = fit_steps(samples)
    assert fit is not None
    assert min(fit.base_s, fit.per_seq_s, fit.per_token_s, fit.per_context_s) >= 0
    assert fit_steps([(4, 4, 40, 0.05)] * 50) is None


def test_the_model_learns_after_enough_steps_and_follows_a_slowdown() -> None:
    model = StepModel(window=64, refit_every=8, min_samples=16)
    for sample in observed(TRUE, 15):
        model.observe(*sample)
    assert not model.fitted
    for sample in observed(TRUE, 49, seed=1):
        model.observe(*sample)
    assert model.fit is not None
    fast = model.fit.predict(16, 16, 1600)
    slow_fit = StepFit(TRUE.base_s * 3, TRUE.per_seq_s * 3, TRUE.per_token_s * 3, 3e-6)
    for sample in observed(slow_fit, 64, seed=2):  # its cores are shared now
        model.observe(*sample)
    assert model.fit.predict(16, 16, 1600) == pytest.approx(3 * fast, rel=0.15)


def test_seats_and_tokens_at_a_step_bound() -> None:
    fit = StepFit(base_s=0.020, per_seq_s=0.004, per_token_s=0.001)
    # A decode step of n costs 0.020 + 0.005 n: within 0.1 s, 16 sequences.
    assert fit.max_seqs(0.1, cap=128) == 16
    assert fit.max_seqs(0.1, cap=8) == 8
    assert fit.max_seqs(0.001, cap=8) == 1  # always progress
    # With 10 sequences (0.060 s of them), 0.040 s is left: 40 tokens in all.
    assert fit.max_tokens(0.1, num_seqs=10, cap=2048) == 40
    assert fit.max_tokens(0.01, num_seqs=10, cap=2048) == 10  # their decodes, at least


def learned(fit: StepFit) -> StepModel:
    model = StepModel()
    model.fit = fit
    return model


def test_an_itl_target_bounds_the_running_batch() -> None:
    sched = make_scheduler(max_num_seqs=64, max_num_batched_tokens=4096, itl_target_s=0.1)
    sched.step_model = learned(StepFit(base_s=0.020, per_seq_s=0.004, per_token_s=0.001))
    for i in range(30):
        sched.add(make_request(f"r{i}", prompt_len=4, max_tokens=50))
    # headroom 0.8: steps of at most 0.08 s, so (0.08 - 0.02) / 0.005 = 12 seats.
    assert sched.seats() == 12
    sched.schedule()
    assert sched.num_running == 12 and sched.num_waiting == 18
    unbounded = make_scheduler(max_num_seqs=64, max_num_batched_tokens=4096)
    unbounded.step_model = sched.step_model
    for i in range(30):
        unbounded.add(make_request(f"r{i}", prompt_len=4, max_tokens=50))
    unbounded.schedule()
    assert unbounded.num_running == 30


def test_an_itl_target_shortens_a_long_prompts_chunks_beside_running_decodes() -> None:
    fit = StepFit(base_s=0.010, per_seq_s=0.0, per_token_s=0.0001)
    sched = make_scheduler(
        num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=2048, itl_target_s=0.1
    )
    sched.step_model = learned(fit)
    sched.add(make_request("short", prompt_len=4, max_tokens=100))
    step(sched)  # its prompt: it decodes from now on
    sched.add(make_request("long", prompt_len=1500, max_tokens=10))
    out = sched.schedule()
    chunk = {r.request_id: n for r, n in out.scheduled}
    assert chunk["short"] == 1
    # 0.08 s a step: (0.08 - 0.01) / 0.0001 = 700 tokens, the decode's one included.
    assert out.num_scheduled_tokens <= 700
    assert 0 < chunk["long"] < 1500
    assert fit.predict(len(out.scheduled), out.num_scheduled_tokens) <= 0.08 + 1e-9


def test_without_a_learned_model_the_target_bounds_nothing() -> None:
    sched = make_scheduler(max_num_seqs=64, max_num_batched_tokens=4096, itl_target_s=0.001)
    sched.step_model = StepModel()
    assert sched.seats() == 64 and sched.token_budget() == 4096
