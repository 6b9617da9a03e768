"""One load level's outcomes, reduced: counts, latency percentiles, goodput, the fleet.

Pure functions over `loadgen.Outcome`s and `/admin/fleet` documents.
"""

from dataclasses import dataclass, field
from typing import Any

from benchmarks.loadgen import Outcome, percentile
from benchmarks.slo.plan import Level, Targets

ITL_RULES = ("p99", "max")


def request_gap_s(itl_s: list[float], rule: str) -> float | None:
    """The inter-token gap of one request that the ITL target is held to: its own p99
    (`loadgen.percentile`; with under 100 gaps that is its largest or second largest)
    or its largest (`max`). None: one token or none, no gap to hold."""
    if rule not in ITL_RULES:
        raise ValueError(f"itl rule {rule!r}; expected one of {ITL_RULES}")
    if not itl_s:
        return None
    return max(itl_s) if rule == "max" else percentile(itl_s, 99)


def met_targets(o: Outcome, targets: Targets, rule: str = "p99") -> bool:
    """Whether one request counts toward goodput: accepted, its stream ended without an
    error, first token within `targets.ttft_s`, and its gap (`request_gap_s`) within
    `targets.itl_s`."""
    if not o.ok or o.ttft_s is None or o.ttft_s > targets.ttft_s:
        return False
    gap = request_gap_s(o.itl_s, rule)
    return gap is None or gap <= targets.itl_s


@dataclass
class LevelResult:
    """One variant at one level of one mix. Latencies over accepted requests (HTTP 200)."""

    variant: str  # switchyard, baseline, oracle, llama-server
    mix: str
    factor: float  # x the measured capacity
    rate_per_s: float  # Poisson rate offered
    duration_s: float  # arrivals' window
    elapsed_s: float  # until the last request ended
    offered: int
    accepted: int  # HTTP 200
    refused_retry_after: int  # 429/503 carrying Retry-After
    refused_other: int  # any other non-200 answer
    no_response: int  # transport error before any status (connection refused, reset)
    failed_after_accept: int  # 200, then the stream errored or was cut
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None  # over every gap of every accepted stream
    itl_p99_s: float | None
    num_good: int  # met both targets (`met_targets`)
    goodput_per_s: float  # num_good / duration_s
    # Per pool that answered (x-switchyard-model; "-" for none): accepted, good,
    # ttft_p99_s, itl_p99_s; what the checks hold to each pool's own targets.
    by_pool: dict[str, dict[str, Any]] = field(default_factory=dict)
    replicas_max: dict[str, int] = field(default_factory=dict)  # most seen, per pool
    max_replicas: dict[str, int] = field(default_factory=dict)  # configured, per pool
    over_max_samples: int = 0  # fleet polls with a pool above its max_replicas
    stall_episodes: int = 0  # a replica turning `stalled` (none is really blocked here)
    note: str = ""  # the oracle's max_num_seqs, an error


def summarise_level(
    variant: str,
    mix: str,
    level: Level,
    outcomes: list[Outcome],
    *,
    duration_s: float,
    elapsed_s: float,
    targets: dict[str, Targets],
    default: Targets,
    itl_rule: str = "p99",
    fleet_samples: list[dict[str, Any]] | None = None,
) -> LevelResult:
    """The level's figures. A request is held to the targets of the pool that answered it
    (`targets[o.pool]`), or `default` when none did."""
    accepted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status not in (0, 200)]
    with_retry = [o for o in refused if o.status in (429, 503) and o.retry_after_s is not None]
    good = [o for o in accepted if met_targets(o, targets.get(o.pool or "", default), itl_rule)]
    by_pool: dict[str, dict[str, Any]] = {}
    for pool in sorted({o.pool or "-" for o in accepted}):
        mine = [o for o in accepted if (o.pool or "-") == pool]
        by_pool[pool] = {
            "accepted": len(mine),
            "good": sum(1 for o in good if (o.pool or "-") == pool),
            "ttft_p99_s": percentile([o.ttft_s for o in mine if o.ttft_s is not None], 99),
            "itl_p99_s": percentile([g for o in mine for g in o.itl_s], 99),
        }
    samples = fleet_samples or []
    replicas_max, max_replicas = fleet_extent(samples)
    return LevelResult(
        variant=variant,
        mix=mix,
        factor=level.factor,
        rate_per_s=level.rate_per_s,
        duration_s=duration_s,
        elapsed_s=round(elapsed_s, 3),
        offered=len(outcomes),
        accepted=len(accepted),
        refused_retry_after=len(with_retry),
        refused_other=len(refused) - len(with_retry),
        no_response=sum(1 for o in outcomes if o.status == 0),
        failed_after_accept=sum(1 for o in accepted if o.error is not None),
        ttft_p50_s=percentile([o.ttft_s for o in accepted if o.ttft_s is not None], 50),
        ttft_p99_s=percentile([o.ttft_s for o in accepted if o.ttft_s is not None], 99),
        itl_p50_s=percentile([g for o in accepted for g in o.itl_s], 50),
        itl_p99_s=percentile([g for o in accepted for g in o.itl_s], 99),
        num_good=len(good),
        goodput_per_s=round(len(good) / max(duration_s, 1e-9), 3),
        by_pool=by_pool,
        replicas_max=replicas_max,
        max_replicas=max_replicas,
        over_max_samples=count_over_max(samples),
        stall_episodes=count_stall_episodes(samples),
    )


# -- the fleet, as /admin/fleet shows it ----------------------------------------------------


def compact_fleet(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per pool: replicas (every one the supervisor lists: starting, draining and
    restarting count), their states, max_replicas, and which are `stalled`."""
    out = {}
    for pool, p in doc.items():
        if not isinstance(p, dict):
            continue
        reps = p.get("replicas") or p.get("workers") or []
        states: dict[str, int] = {}
        for r in reps:
            states[r.get("state", "?")] = states.get(r.get("state", "?"), 0) + 1
        out[pool] = {
            "replicas": len(reps),
            "states": states,
            "max_replicas": p.get("max_replicas"),
            "stalled": sorted(
                str(r.get("id") or r.get("url")) for r in reps if r.get("state") == "stalled"
            ),
        }
    return out


def fleet_extent(samples: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """(most replicas seen, configured max_replicas) per pool over the samples."""
    seen: dict[str, int] = {}
    limit: dict[str, int] = {}
    for s in samples:
        for pool, p in s["pools"].items():
            seen[pool] = max(seen.get(pool, 0), p["replicas"])
            if p.get("max_replicas") is not None:
                limit[pool] = p["max_replicas"]
    return seen, limit


def count_over_max(samples: list[dict[str, Any]]) -> int:
    """Samples in which some pool listed more replicas than its max_replicas."""
    return sum(
        any(
            p.get("max_replicas") is not None and p["replicas"] > p["max_replicas"]
            for p in s["pools"].values()
        )
        for s in samples
    )


def count_stall_episodes(samples: list[dict[str, Any]]) -> int:
    """How many times a replica was seen turning `stalled` (stalled in a sample and not in
    the one before, or in the first). Nothing here blocks an engine thread, so every one
    is a false stall."""
    before: set[str] = set()
    episodes = 0
    for s in samples:
        now = {f"{pool}/{rid}" for pool, p in s["pools"].items() for rid in p["stalled"]}
        episodes += len(now - before)
        before = now
    return episodes
