"""The HTTP side reads only what the engine thread published: /load, admission, /ready
and /metrics over an engine whose live scheduler and KV pool refuse to be read."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from workers.api.types import ApiError
from workers.engine.async_engine import AsyncEngine
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.stats import EngineStats
from workers.server.config import WorkerConfig
from workers.server.metrics import EngineCollector, WorkerMetrics
from workers.server.service import WorkerService


class LiveState:
    """Stands for the engine thread's lists: any read from another thread fails."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the HTTP side read the engine's live `{name}`")


class PublishingEngine:
    """An LLMEngine as AsyncEngine and the service see it, minus the model."""

    max_model_len = 1024
    tokenizer = None
    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=1000))
    scheduler = LiveState()
    kv = LiveState()

    def __init__(self, stats: EngineStats) -> None:
        self.published = stats
        self.on_scheduled = None

    def stats(self, now: float) -> EngineStats:
        return self.published

    def has_unfinished_requests(self) -> bool:
        raise AssertionError("the HTTP side asked the live engine whether it is idle")


def make_stats(**kw) -> EngineStats:
    fields = dict(
        time_s=100.0,
        num_steps=7,
        num_running=3,
        waiting_tokens=(40, 8),
        num_held=0,
        max_num_seqs=4,
        block_size=16,
        kv_blocks_used=12,
        kv_blocks_free=20,
        kv_blocks_total=32,
        prefix_cache_query_tokens=90,
        prefix_cache_hit_tokens=32,
        num_preemptions=2,
        num_failed_requests=1,
        num_generated_tokens=55,
    )
    return EngineStats(**{**fields, **kw})


def make_service(stats: EngineStats, now: float = 100.0, **config):
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "small")
    aengine = AsyncEngine(PublishingEngine(stats))  # not started: nothing else publishes
    cfg = WorkerConfig(served_model_names=["small"], **config)
    service = WorkerService(cfg, metrics, aengine, clock=lambda: now)
    registry.register(EngineCollector(lambda: aengine.stats, "small"))
    return service, registry


def test_load_reports_the_published_snapshot():
    service, _ = make_service(make_stats())
    report = service.load()
    assert (report.num_running, report.num_waiting, report.queued_prompt_tokens) == (3, 2, 48)
    assert (report.kv_blocks_used, report.kv_blocks_total) == (12, 32)
    assert (report.kv_free_tokens, report.kv_total_tokens) == (20 * 16, 32 * 16)
    assert report.state == "ready" and report.max_model_len == 1024


def test_metrics_report_the_published_snapshot():
    _, registry = make_service(make_stats())
    value = registry.get_sample_value
    labels = {"model_name": "small"}
    assert value("switchyard_worker_num_requests_running", labels) == 3
    assert value("switchyard_worker_num_requests_waiting", labels) == 2
    assert value("switchyard_worker_kv_cache_usage_perc", labels) == 12 / 32
    assert value("switchyard_worker_prefix_cache_hits_total", labels) == 32
    assert value("switchyard_worker_num_preemptions_total", labels) == 2
    assert value("switchyard_worker_request_errors_total", labels) == 1


def test_metrics_count_speculative_drafts_proposed_and_accepted():
    stats = make_stats(num_spec_proposed_tokens=40, num_spec_accepted_tokens=27)
    _, registry = make_service(stats)
    labels = {"model_name": "small"}
    assert registry.get_sample_value("switchyard_worker_spec_proposed_tokens_total", labels) == 40
    assert registry.get_sample_value("switchyard_worker_spec_accepted_tokens_total", labels) == 27


def test_admission_walks_the_published_line():
    # One seat left: the first waiting request takes it, the second counts against the line.
    service, _ = make_service(make_stats(), max_waiting_requests=1)
    with pytest.raises(ApiError) as refused:
        service.admit(8)
    assert refused.value.status == 503 and refused.value.retry_after_s is not None
    roomy, _ = make_service(make_stats(max_num_seqs=64), max_waiting_requests=1)
    assert roomy.admit(8) is roomy.engine


def test_a_busy_snapshot_older_than_the_stall_timeout_reads_stalled():
    busy = make_stats(time_s=100.0)
    assert make_service(busy, now=104.0, stall_timeout_s=5.0)[0].state == "ready"
    assert make_service(busy, now=106.0, stall_timeout_s=5.0)[0].state == "stalled"
    idle = replace(busy, num_running=0, waiting_tokens=())
    assert make_service(idle, now=1000.0, stall_timeout_s=5.0)[0].state == "ready"


def test_requests_handed_in_and_not_yet_published_count_as_waiting():
    # The engine thread is stuck: what arrives since its last snapshot is still queued.
    service, _ = make_service(make_stats(num_running=0, waiting_tokens=()))
    assert service.engine.is_idle()

    async def submit_and_read():
        req = Request("r1", list(range(20)), SamplingParams(max_tokens=4), arrival_time=0.0)
        stream = service.engine.generate(req)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # `generate` puts it in the inbox, then waits for outputs
        report, idle = service.load(), service.engine.is_idle()
        task.cancel()
        return report, idle

    report, idle = asyncio.run(submit_and_read())
    assert (report.num_waiting, report.queued_prompt_tokens) == (1, 20) and not idle
