"""The engine thread publishes its stats: after a step the snapshot shows it, and during a
step the HTTP side's readers (/load, admission, /ready, /metrics) get the batch being run
from the snapshot alone, with the scheduler and KV pool out of their reach."""

import asyncio
import threading
import time

from prometheus_client import CollectorRegistry

from tests.support.waiting import eventually
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.server.config import WorkerConfig
from workers.server.metrics import EngineCollector, WorkerMetrics
from workers.server.service import WorkerService

PROMPT = list(range(5, 25))


class OffLimits:
    def __getattr__(self, name: str):
        raise AssertionError(f"read the engine's live `{name}` from another thread")


def make_engine(path) -> LLMEngine:
    cfg = EngineConfig(num_kv_blocks=64, block_size=4, scheduler=SchedulerConfig(max_num_seqs=4))
    return LLMEngine.from_pretrained(path, cfg)


def test_after_the_steps_the_snapshot_holds_what_they_did(llama_dir):
    engine = make_engine(llama_dir)
    aengine = AsyncEngine(engine)
    before = aengine.stats
    aengine.start()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def run() -> None:
        async for _ in aengine.generate(
            engine.make_request("a", prompt_token_ids=PROMPT, params=params)
        ):
            pass

    try:
        asyncio.run(run())
        # Published before the last output was delivered: no wait needed.
        after = aengine.stats
    finally:
        aengine.shutdown()
    assert before.num_steps == 0 and before.kv_blocks_used == 0
    assert after.num_steps >= 6 and after.num_generated_tokens == 6
    assert after.num_running == 0 and after.waiting_tokens == () and after.kv_blocks_used == 0
    assert after.prefix_cache_query_tokens == len(PROMPT)
    assert after.time_s > before.time_s and not after.has_unfinished


def test_during_a_step_readers_get_the_running_batch_from_the_snapshot_alone(llama_dir):
    engine = make_engine(llama_dir)
    gate, inside = threading.Event(), threading.Event()
    original = engine.runner.execute

    def stuck(*args, **kwargs):
        inside.set()
        gate.wait(30)
        return original(*args, **kwargs)

    engine.runner.execute = stuck
    aengine = AsyncEngine(engine)
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "small")
    service = WorkerService(WorkerConfig(max_waiting_requests=1), metrics, aengine)
    registry.register(EngineCollector(lambda: aengine.stats, "small"))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    reqs = [engine.make_request(f"r{i}", prompt_token_ids=PROMPT, params=params) for i in range(6)]

    async def run() -> dict:
        streams = [aengine.generate(r) for r in reqs]
        tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)  # all six in the inbox, so the first step takes them all
        aengine.start()
        await asyncio.to_thread(inside.wait, 30)
        live = engine.scheduler, engine.kv
        engine.scheduler, engine.kv = OffLimits(), OffLimits()  # type: ignore[assignment]
        try:
            seen = {
                "load": service.load(),
                "state": service.state,
                "idle": aengine.is_idle(),
                "running": registry.get_sample_value(
                    "switchyard_worker_num_requests_running", {"model_name": "small"}
                ),
            }
            try:
                service.admit(len(PROMPT))
                seen["admitted"] = True
            except Exception:
                seen["admitted"] = False
        finally:
            engine.scheduler, engine.kv = live
            gate.set()
        for t in tasks:
            t.cancel()
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        gate.set()
        aengine.shutdown()
    load = seen["load"]
    # 4 seats: 4 in the batch being run (their KV allocated), 2 behind it.
    assert load.num_running == 4 and load.kv_blocks_used > 0
    assert load.kv_free_tokens == (load.kv_blocks_total - load.kv_blocks_used) * 4
    assert load.num_waiting == 2 and load.queued_prompt_tokens == 2 * len(PROMPT)
    assert seen["running"] == 4
    assert seen["state"] == "ready" and not seen["idle"]
    assert seen["admitted"] is False  # no seat: 2 waiting already fill a line of 1


def test_an_idle_loop_keeps_its_heartbeat_fresh(llama_dir):
    aengine = AsyncEngine(make_engine(llama_dir), idle_wait_s=0.05)
    aengine.start()
    try:
        first = aengine.stats.time_s
        assert eventually(lambda: aengine.stats.time_s > first + 0.05, timeout_s=5)
        assert aengine.is_idle() and time.monotonic() - aengine.stats.time_s < 1.0
    finally:
        aengine.shutdown()
