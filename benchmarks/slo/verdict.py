"""The oracle's best run per level, and issue 34's targets as PASS / FAIL checks.

Pure: `LevelResult`s in, `Check`s out. A check never relaxes a target to pass; one that
cannot be judged (a variant skipped, a level not run) is SKIP and says why.
"""

from dataclasses import dataclass, replace

from benchmarks.slo.levels import LevelResult
from benchmarks.slo.plan import Targets

TOP_FACTOR = 3.0  # the overload level
SHARE = 0.9  # goodput at 3x against 1x and against the oracle


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str  # the figures it was judged on


def select_oracle(by_seqs: dict[int, list[LevelResult]]) -> list[LevelResult]:
    """Per level (by factor), the max_num_seqs run with the most goodput; a tie goes to
    the smaller batch. Each result is relabelled `oracle`, its `note` naming the batch."""
    best: dict[float, tuple[int, LevelResult]] = {}
    for seqs in sorted(by_seqs):
        for r in by_seqs[seqs]:
            held = best.get(r.factor)
            if held is None or r.goodput_per_s > held[1].goodput_per_s:
                best[r.factor] = (seqs, r)
    return [
        replace(r, variant="oracle", note=f"max_num_seqs={seqs}")
        for _, (seqs, r) in sorted(best.items())
    ]


def _at(results: list[LevelResult], factor: float) -> LevelResult | None:
    return next((r for r in results if r.factor == factor), None)


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def both_met_everything(ours: LevelResult, peer: LevelResult) -> bool:
    """Both met the targets for every request of the same offered load: at a light level
    no server can be ahead, as goodput cannot exceed what was offered. Any request missed
    by either makes it a comparison again."""
    return ours.offered == peer.offered == ours.num_good == peer.num_good


def _pool_check(
    name: str, top: LevelResult, key: str, targets: dict[str, Targets], default: Targets
) -> Check:
    """Every pool's p99 (`key`) at the top level within that pool's own target."""
    if not top.by_pool:
        return Check(name, "FAIL", f"no request accepted at {top.factor:g}x")
    parts, ok = [], True
    for pool, p in top.by_pool.items():
        t = targets.get(pool, default)
        limit = t.ttft_s if key == "ttft_p99_s" else t.itl_s
        value = p[key]
        if value is None and key == "itl_p99_s":  # single-token streams: no gap to hold
            parts.append(f"{pool} no gaps")
            continue
        met = value is not None and value <= limit
        ok &= met
        parts.append(f"{pool} {_secs(value)} {'<=' if met else '>'} {limit:g} s")
    return Check(name, "PASS" if ok else "FAIL", ", ".join(parts))


def mix_checks(
    ours: list[LevelResult],
    targets: dict[str, Targets],
    default: Targets,
    *,
    oracle: list[LevelResult] | None,
    llama: list[LevelResult] | None,
    why_no_oracle: str = "skipped",
    why_no_llama: str = "skipped",
) -> list[Check]:
    """The issue's per-mix targets for our stack's sweep (`ours`, one result per level)."""
    if not ours:
        return [Check("the sweep ran", "FAIL", "no level of our stack finished")]
    top = max(ours, key=lambda r: r.factor)
    at = f"at {top.factor:g}x" + ("" if top.factor == TOP_FACTOR else " (the issue's is 3x)")
    checks = [
        _pool_check(f"{at}: accepted TTFT p99 <= target", top, "ttft_p99_s", targets, default),
        _pool_check(f"{at}: accepted ITL p99 <= target", top, "itl_p99_s", targets, default),
    ]
    failed = {f"{r.factor:g}x": r.failed_after_accept for r in ours}
    checks.append(
        Check(
            "0 failed after acceptance (every level)",
            "PASS" if not any(failed.values()) else "FAIL",
            ", ".join(f"{k} {v}" for k, v in failed.items()),
        )
    )
    one = _at(ours, 1.0)
    name = f"goodput {at} >= {SHARE:.0%} of goodput at 1x"
    if one is None:
        checks.append(Check(name, "SKIP", "no 1x level in --factors"))
    else:
        need = SHARE * one.goodput_per_s
        checks.append(
            Check(
                name,
                "PASS" if top.goodput_per_s >= need else "FAIL",
                f"{top.goodput_per_s:.3f}/s vs {SHARE:.0%} of {one.goodput_per_s:.3f}/s "
                f"= {need:.3f}/s",
            )
        )
    name = f"goodput {at} >= {SHARE:.0%} of the oracle's"
    best = _at(oracle or [], top.factor)
    if best is None:
        checks.append(Check(name, "SKIP", f"no oracle at {top.factor:g}x ({why_no_oracle})"))
    else:
        need = SHARE * best.goodput_per_s
        checks.append(
            Check(
                name,
                "PASS" if top.goodput_per_s >= need else "FAIL",
                f"{top.goodput_per_s:.3f}/s vs {SHARE:.0%} of {best.goodput_per_s:.3f}/s "
                f"({best.note}) = {need:.3f}/s",
            )
        )
    name = "goodput ahead of llama-server's at every level"
    if not llama:
        checks.append(Check(name, "SKIP", f"llama-server not run ({why_no_llama})"))
    else:
        parts, ok = [], True
        for r in ours:
            peer = _at(llama, r.factor)
            if peer is None:
                ok = False
                parts.append(f"{r.factor:g}x: llama-server missing")
                continue
            if both_met_everything(r, peer):
                parts.append(f"{r.factor:g}x tie: both met all {r.offered} offered")
                continue
            ahead = r.goodput_per_s > peer.goodput_per_s
            ok &= ahead
            sign = ">" if ahead else "<="
            parts.append(f"{r.factor:g}x {r.goodput_per_s:.3f} {sign} {peer.goodput_per_s:.3f}")
        checks.append(Check(name, "PASS" if ok else "FAIL", "; ".join(parts)))
    return checks


def fleet_checks(
    stall_episodes: int,
    over_max_samples: int,
    replicas_max: dict[str, int],
    max_replicas: dict[str, int],
    num_samples: int,
) -> list[Check]:
    """Over our stack's whole sweep (every mix, every level): no false stall, no pool
    above its max_replicas."""
    if num_samples == 0:
        reason = "no /admin/fleet sample was taken"
        return [Check("0 false stalls", "FAIL", reason), Check("0 above max", "FAIL", reason)]
    extent = ", ".join(
        f"{pool} {n} (max {max_replicas.get(pool, '?')})"
        for pool, n in sorted(replicas_max.items())
    )
    return [
        Check(
            "0 false stalls over the sweep",
            "PASS" if stall_episodes == 0 else "FAIL",
            f"{stall_episodes} replica(s) turned stalled in {num_samples} polls",
        ),
        Check(
            "0 replicas above max_replicas over the sweep",
            "PASS" if over_max_samples == 0 else "FAIL",
            f"most seen: {extent}; {over_max_samples} poll(s) above",
        ),
    ]
