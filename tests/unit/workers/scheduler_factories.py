"""Factories for scheduler tests: a scheduler over a real KV manager, requests, and
simulated engine steps (every fully computed request gets one token; it finishes once
it has `max_tokens` of them)."""

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcache import KVCacheManager
from workers.engine.config import SchedulerConfig
from workers.engine.request import FinishReason, Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import (
    Scheduler,
    SchedulerOutput,
)

BLOCK_SIZE = 4
REPO_ROOT = Path(__file__).resolve().parents[3]


def make_clock(start: float = 0.0) -> tuple[Callable[[], float], Callable[[float], None]]:
    """A fake clock and its setter."""
    now = start

    def clock() -> float:
        return now

    def set_now(t: float) -> None:
        nonlocal now
        now = t

    return clock, set_now


def make_scheduler(
    *,
    num_blocks: int = 256,
    clock: Callable[[], float] | None = None,
    enable_prefix_caching: bool = True,
    **config: Any,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv, clock or make_clock()[0])


def make_request(
    request_id: str,
    prompt_len: int = 8,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    deadline: float | None = None,
    arrival_time: float = 0.0,
    prompt: list[int] | None = None,
    tenant: str | None = None,
) -> Request:
    # Distinct token ids per request id so no two requests share a prefix by accident.
    base = (zlib.crc32(request_id.encode()) % 10_000) * 1_000
    tokens = prompt if prompt is not None else [base + i for i in range(prompt_len)]
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival_time,
        priority=priority,
        tenant=tenant,
        deadline=deadline,
    )


def make_requests(n: int, prompt_len: int = 8, *, prefix: str = "r", **kwargs) -> list[Request]:
    return [
        make_request(f"{prefix}{i}", prompt_len, arrival_time=float(i), **kwargs) for i in range(n)
    ]


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert all(n >= 1 for _, n in out.scheduled)
    assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
    pool = sched.kv.pool
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


def step(sched: Scheduler, token_id: int = 7) -> SchedulerOutput:
    """One simulated engine step."""
    out = sched.schedule()
    check_invariants(sched, out)
    sched.advance(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token_id)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, FinishReason.LENGTH)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 2_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, f"no progress: {sched.waiting=} {sched.running=}"
        outs.append(step(sched))
    return outs


def scheduled_ids(out: SchedulerOutput) -> list[str]:
    return [r.request_id for r, _ in out.scheduled]
