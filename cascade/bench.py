"""Scoring latency of a difficulty scorer: p50/p99 per request on one core.

A measurement, not a test: `measure_scoring_latency` pins the process to one CPU,
limits BLAS/OpenMP (and torch, when already imported) to one thread, scores each
prompt once after a warm-up pass, and restores the affinity afterwards.
"""

import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from cascade.classifier import DifficultyScorer
from cascade.features import RequestView


@dataclass(frozen=True)
class LatencyReport:
    scorer: str
    num_prompts: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    mean_prompt_chars: float
    cpu: str  # which core, and how threads were limited

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def one_core() -> Iterator[str]:
    """Pin to one CPU and one thread for BLAS/OpenMP/torch; yields a description."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # comes with scikit-learn; without it nothing multithreads here
        threadpool_limits = None

    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    cpu = min(saved) if saved else None
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if torch is not None:
        torch.set_num_threads(1)
    limits = threadpool_limits(limits=1) if threadpool_limits else nullcontext()
    try:
        with limits:
            yield f"cpu {cpu} (affinity pinned), 1 thread" if saved else "1 thread"
    finally:
        if saved:
            os.sched_setaffinity(0, saved)
        if torch is not None and torch_threads is not None:
            torch.set_num_threads(torch_threads)


def synthetic_prompts(num: int, seed: int = 0) -> list[str]:
    """Deterministic prompts of 5..800 words, some with numbers, options and code."""
    rng = random.Random(seed)
    words = (
        "the of which following is most likely a an to in court plaintiff patient cell "
        "function value energy market theory argument statement scenario model data "
        "explain why how compute returns probability equation"
    ).split()
    out = []
    for i in range(num):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(5, 800)))
        if i % 3 == 0:
            body += f" Compute {rng.randint(2, 999)} * {rng.randint(2, 99)} = ?"
        if i % 5 == 0:
            body += "\n```python\ndef f(x):\n    return x ** 2\n```"
        out.append(body + "\nA. one\nB. two\nC. three\nD. four\nAnswer:")
    return out


def measure_scoring_latency(
    scorer: DifficultyScorer, views: Sequence[RequestView], show_progress: bool = True
) -> LatencyReport:
    """Time `scorer.score` on each request (chat messages are not rebuilt: text only)."""
    if not views:
        raise ValueError("no prompts to time")
    with one_core() as cpu:
        for v in views[:50]:
            scorer.score(v.text, max_tokens=v.max_tokens)
        times_s = []
        clock = time.perf_counter
        for v in tqdm(views, desc="scoring", disable=not show_progress, leave=False):
            t0 = clock()
            scorer.score(v.text, max_tokens=v.max_tokens)
            times_s.append(clock() - t0)
    ms = np.array(times_s) * 1e3
    return LatencyReport(
        scorer=scorer.name,
        num_prompts=len(views),
        p50_ms=float(np.percentile(ms, 50)),
        p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)),
        max_ms=float(ms.max()),
        mean_ms=float(ms.mean()),
        mean_prompt_chars=float(np.mean([len(v.text) for v in views])),
        cpu=cpu,
    )
