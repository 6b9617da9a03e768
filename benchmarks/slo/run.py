"""The SLO bench's options, and what one run has gathered so far."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.slo.levels import LevelResult
from benchmarks.slo.plan import Level, Targets


@dataclass
class SloBenchOptions:
    config: Path = Path("configs/serve.yaml")
    out: Path | None = Path("bench-results/slo.json")
    mixes: tuple[str, ...] = ("tour", "long-heavy")
    factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 3.0)
    duration_s: float = 20.0  # arrivals per level
    capacity_s: float = 15.0  # the closed loop's counted window (after a 3 s warm-up)
    capacity_concurrency: int = 8
    capacity_per_s: float | None = None  # given: used for every mix, nothing measured
    skip: frozenset[str] = frozenset()  # of plan.SKIPPABLE
    oracle_seqs: tuple[int, ...] = (2, 4, 8, 16)
    oracle_duration_s: float | None = None  # None: half of duration_s
    llama_slots: int = 4
    llama_threads: int = 2
    guidellm_levels: int = 5  # GuideLLM's sweep size (synchronous, throughput, rates)
    guidellm_data: str = "prompt_tokens=256,output_tokens=64"
    itl_rule: str = "p99"  # levels.ITL_RULES
    tenants: int = 2
    seed: int = 0
    settle_s: float = 3.0  # pause between levels
    work_dir: Path | None = None  # None: a fresh temporary directory (kept: logs)


@dataclass
class Run:
    """One bench run: its inputs, and what it has measured so far (`report.report`)."""

    opts: SloBenchOptions
    original: dict[str, Any]  # the serve config as read
    base_dir: Path  # its directory: what its relative paths resolve against
    model_dirs: dict[str, Path]  # each pool's checkpoint, fetched before any stack starts
    targets: dict[str, Targets]
    default: Targets  # for requests no pool answered (llama-server)
    work_dir: Path
    say: Callable[[str], None]
    levels: dict[str, list[Level]] = field(default_factory=dict)  # per mix
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)  # per mix
    # variant -> mix -> one result per level (the oracle: its best per level)
    results: dict[str, dict[str, list[LevelResult]]] = field(default_factory=dict)
    # variant -> mix -> per level, every request's outcome (loadgen.Outcome as a dict)
    outcomes: dict[str, dict[str, list[list[dict]]]] = field(default_factory=dict)
    by_seqs: dict[int, dict[str, list[LevelResult]]] = field(default_factory=dict)  # oracle
    fleet: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # samples per stack
    errors: dict[str, str] = field(default_factory=dict)  # per variant or mix
    guidellm: dict[str, Any] | None = None

    def keep(self, variant: str, r: LevelResult, outcomes: list[dict]) -> None:
        self.results.setdefault(variant, {}).setdefault(r.mix, []).append(r)
        self.outcomes.setdefault(variant, {}).setdefault(r.mix, []).append(outcomes)


def progress(t0: float) -> Callable[[str], None]:
    """Progress lines stamped with the seconds since `t0`."""

    def say(message: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f} s] {message}", flush=True)

    return say
