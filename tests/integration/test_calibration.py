"""Start-up calibration: a worker knows what a step costs before its first request, and
calibrating changes nothing a client or a counter can see."""

import threading

import httpx
import pytest
import uvicorn

from tests.support.waiting import eventually
from tests.support.worker import free_port
from tests.support.worker_client import load_report
from workers.engine.calibration import calibrate, plan
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.server.config import WorkerConfig
from workers.server.main import build_worker

PROMPT = list(range(5, 45))
P = "switchyard_worker_"


def engine_config(itl_target_s: float | None = 0.2, calibrate: bool = True) -> EngineConfig:
    scheduler = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=256, itl_target_s=itl_target_s
    )
    return EngineConfig(num_kv_blocks=128, block_size=16, scheduler=scheduler, calibrate=calibrate)


def test_the_plan_spans_prefill_lengths_and_batch_sizes_within_the_limits() -> None:
    rounds = plan(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=4096, kv_tokens=9000)
    assert rounds[:3] == [(1, 64), (1, 256), (1, 768)]
    assert [n for n, _ in rounds[3:]] == [1, 2, 4, 8, 16, 32]
    # A short context, a small budget and little KV cap every round.
    small = plan(max_num_seqs=100, max_num_batched_tokens=128, max_model_len=64, kv_tokens=400)
    assert all(length <= 60 and n * (length + 4) <= 400 for n, length in small)
    assert max(n for n, _ in small) == 400 // 20
    assert (1, 60) in small


def test_calibration_fits_the_step_model_and_leaves_no_trace(llama_dir) -> None:
    engine = LLMEngine.from_pretrained(llama_dir, engine_config())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    uncalibrated = LLMEngine.from_pretrained(llama_dir, engine_config())
    [expected] = uncalibrated.generate([PROMPT], params)
    assert not engine.step_model.fitted and engine.stats(0.0).decode_step_s is None

    result = calibrate(engine)

    assert result.fitted and result.num_steps >= engine.step_model.min_samples
    stats = engine.stats(0.0)
    assert stats.decode_step_s is not None and stats.decode_step_s > 0
    assert stats.prefill_tokens_per_s is not None and stats.prefill_tokens_per_s > 0
    # Nothing left running or held, every block free, every counter as it was.
    assert not engine.has_unfinished_requests() and stats.kv_blocks_used == 0
    assert stats.num_generated_tokens == 0 and engine.num_prompt_tokens_computed == 0
    assert stats.prefix_cache_query_tokens == 0 and stats.prefix_cache_hit_tokens == 0
    # A real request afterwards: the same greedy tokens, nothing from calibration's cache.
    [got] = engine.generate([PROMPT], params)
    assert got.token_ids == expected.token_ids and got.num_cached_tokens == 0


def test_calibration_refuses_a_busy_engine(llama_dir) -> None:
    engine = LLMEngine.from_pretrained(llama_dir, engine_config())
    engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle"):
        calibrate(engine)


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_worker_reports_its_capacity_from_its_first_ready_load(llama_dir, calibrated) -> None:
    """The worker process's own start-up path (`build_worker`): calibrated, its first
    ready /load already carries seats, step time and prefill rate, with no request served;
    with `calibrate: false` it knows none of them until live steps teach it."""
    app, service = build_worker(
        llama_dir, engine_config(calibrate=calibrated), WorkerConfig(served_model_names=["m"])
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert eventually(lambda: service.state == "ready", timeout_s=60)
        report = load_report(url)
        assert report.state == "ready" and report.num_running == 0
        if calibrated:
            assert report.seats is not None and 1 <= report.seats <= 8
            assert report.decode_step_s is not None and report.decode_step_s > 0
            assert report.prefill_tokens_per_s is not None and report.prefill_tokens_per_s > 0
        else:
            assert report.decode_step_s is None and report.prefill_tokens_per_s is None
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        queried = [
            line
            for line in metrics.splitlines()
            if line.startswith((P + "prefix_cache_queries", P + "request_errors"))
        ]
        assert len(queried) == 2 and all(line.endswith(" 0.0") for line in queried), queried
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if service.engine is not None:
            service.engine.shutdown()


def test_a_failed_calibration_counts_against_nothing(llama_dir) -> None:
    """A broken device fails calibration's first step: the error is raised for the
    worker to log, and the failure counters that end an engine are as they were, so
    the first real requests still fail alone (the engine dies only after its own bound)."""
    engine = LLMEngine.from_pretrained(llama_dir, engine_config())

    def broken(batch, tables):
        raise RuntimeError("device lost")

    engine.runner.execute = broken
    with pytest.raises(RuntimeError, match="device lost"):
        calibrate(engine)
    assert engine._num_failed_steps == 0 and engine.num_failed_requests == 0
    assert not engine.has_unfinished_requests() and not engine.step_model.fitted
    assert engine.kv.pool.num_used_blocks == 0


def test_calibration_puts_back_counters_that_were_not_zero(llama_dir) -> None:
    engine = LLMEngine.from_pretrained(llama_dir, engine_config())
    for _ in range(2):  # the second one hits the first's cached blocks
        engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))
    before = engine.stats(0.0)
    assert before.num_generated_tokens == 8 and before.prefix_cache_hit_tokens > 0
    calibrate(engine)
    after = engine.stats(0.0)
    assert (after.num_generated_tokens, after.num_failed_requests) == (8, 0)
    assert (after.prefix_cache_query_tokens, after.prefix_cache_hit_tokens) == (
        before.prefix_cache_query_tokens,
        before.prefix_cache_hit_tokens,
    )
