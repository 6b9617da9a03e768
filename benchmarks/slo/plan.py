"""What the SLO bench runs: mixes, load levels, targets, and each variant's serve config.

Pure: YAML documents in, YAML documents out; no files, no processes.
"""

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.loadgen import MIXES as KINDS


@dataclass(frozen=True)
class Mix:
    """A workload: which request kinds (benchmarks/loadgen.py), how often each."""

    name: str
    kinds: tuple[str, ...]
    weights: tuple[float, ...] | None = None  # None: uniform, as `switchyard load` does
    model: str = "auto"


MIXES: dict[str, Mix] = {
    # The tour's load (scripts/tour.sh): short, long and shared-prefix, uniform.
    "tour": Mix("tour", KINDS),
    # Long prompts (a few hundred words, 128 tokens out) most of the time.
    "long-heavy": Mix("long-heavy", ("long", "short", "shared-prefix"), (0.8, 0.1, 0.1)),
}

VARIANTS = ("switchyard", "baseline", "oracle", "llama-server")
SKIPPABLE = ("baseline", "oracle", "llama", "guidellm")


@dataclass(frozen=True)
class Level:
    """One offered load: `factor` x the measured capacity, as Poisson arrivals."""

    factor: float
    rate_per_s: float


@dataclass(frozen=True)
class Targets:
    """A pool's latency targets, in seconds."""

    ttft_s: float
    itl_s: float


def plan_levels(capacity_per_s: float, factors: tuple[float, ...]) -> list[Level]:
    """The levels to offer, lowest first (duplicates dropped)."""
    if not capacity_per_s > 0:
        raise ValueError(f"capacity must be > 0 requests/s, got {capacity_per_s}")
    if not factors or any(not f > 0 for f in factors):
        raise ValueError(f"factors must be > 0, got {factors}")
    return [Level(f, round(f * capacity_per_s, 3)) for f in sorted(set(factors))]


def level_seed(seed: int, mix_index: int, level_index: int) -> int:
    """Each (mix, level) has its own arrivals, the same for every variant."""
    return seed * 1_000_003 + mix_index * 1000 + level_index


def targets_from_config(doc: dict[str, Any]) -> dict[str, Targets]:
    """Each pool's TTFT and ITL targets, as `switchyard serve` would apply them.

    The TTFT target of a pool is `pools.<name>.ttft_target_s`, unless
    `gateway.options.ttft_target_s` names the pool (serve lets that win); the ITL target
    is `pools.<name>.itl_target_s`, else `engine.scheduler.itl_target_s`. ValueError
    naming the pools that have no target: goodput needs both.
    """
    options = (doc.get("gateway") or {}).get("options") or {}
    gateway_ttft = options.get("ttft_target_s") or {}
    out, missing = {}, []
    for name, pool in (doc.get("pools") or {}).items():
        pool = pool or {}
        scheduler = (pool.get("engine") or {}).get("scheduler") or {}
        ttft = gateway_ttft.get(name, pool.get("ttft_target_s"))
        itl = pool.get("itl_target_s", scheduler.get("itl_target_s"))
        if ttft is None or itl is None:
            missing.append(name)
        else:
            out[name] = Targets(float(ttft), float(itl))
    if missing or not out:
        raise ValueError(
            f"pools {missing or '(none)'} set no ttft_target_s / itl_target_s: goodput is "
            "measured against them, so the config must give both for every pool"
        )
    return out


def strictest(targets: dict[str, Targets]) -> Targets:
    """The targets for a request no pool answered for (llama-server, a refusal)."""
    return Targets(min(t.ttft_s for t in targets.values()), min(t.itl_s for t in targets.values()))


def _absolute(value: str | None, base_dir: Path) -> str | None:
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base_dir / p).resolve())


def stack_doc(
    original: dict[str, Any],
    base_dir: Path,
    *,
    data_dir: Path,
    port: int,
    model_dirs: dict[str, Path],
    with_targets: bool = True,
    max_num_seqs: int | None = None,
) -> dict[str, Any]:
    """A copy of a serve config for one variant's stack, to be written anywhere.

    Relative paths become absolute against `base_dir` (the original file's directory, as
    serve resolves them); `data_dir` and the gateway's port are the bench's own; Redis is
    embedded (per stack, so variants share nothing); each pool serves `model_dirs[pool]`.
    `with_targets=False` removes the latency targets (today's admission: counts and
    deadlines, the batch by max_num_seqs); `max_num_seqs` sets every pool's static batch
    bound.
    """
    doc = copy.deepcopy(original)  # also unshares the YAML anchors (`engine: *engine`)
    doc["data_dir"] = str(data_dir)
    doc["redis_url"] = None
    doc["models_dir"] = _absolute(doc.get("models_dir"), base_dir)
    gateway = doc.setdefault("gateway", {}) or {}
    doc["gateway"] = gateway
    gateway["host"] = "127.0.0.1"
    gateway["port"] = port
    gateway["admin_key"] = None  # the bench passes its own in the environment
    cascade = doc.get("cascade") or {}
    if cascade.get("classifier_path"):
        cascade["classifier_path"] = _absolute(cascade["classifier_path"], base_dir)
    for name, pool in (doc.get("pools") or {}).items():
        pool = doc["pools"][name] = copy.deepcopy(pool or {})
        if name in model_dirs:
            pool["model_dir"] = str(model_dirs[name])
        elif pool.get("model_dir"):
            pool["model_dir"] = _absolute(pool["model_dir"], base_dir)
        engine = pool.setdefault("engine", {}) or {}
        pool["engine"] = engine
        scheduler = engine.setdefault("scheduler", {}) or {}
        engine["scheduler"] = scheduler
        if not with_targets:
            pool["ttft_target_s"] = None
            pool["itl_target_s"] = None
            scheduler.pop("itl_target_s", None)
        if max_num_seqs is not None:
            scheduler["max_num_seqs"] = max_num_seqs
    if not with_targets:
        (gateway.get("options") or {}).pop("ttft_target_s", None)
    return doc
