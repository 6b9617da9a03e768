"""The SLO bench's printed output: a table per mix, one line per finished level, the checks."""

from collections.abc import Sequence

from benchmarks.slo.levels import LevelResult
from benchmarks.slo.plan import VARIANTS
from benchmarks.slo.verdict import Check

# (header, width) per column; the first two are left-aligned.
COLUMNS = (
    ("level", 6),
    ("variant", 13),
    ("offered/s", 9),
    ("offered", 7),
    ("accepted", 8),
    ("refused RA", 10),
    ("refused", 7),
    ("no resp", 7),
    ("failed", 6),
    ("TTFT p50", 8),
    ("TTFT p99", 8),
    ("ITL p50", 7),
    ("ITL p99", 7),
    ("goodput/s", 9),
    ("replicas", 17),
    ("stalls", 6),
    ("note", 0),
)


def secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def replicas(r: LevelResult) -> str:
    """`small 1/2 large 1/1`: most replicas seen / max_replicas, per pool; `-` without a
    fleet (llama-server)."""
    if not r.replicas_max:
        return "-"
    return " ".join(
        f"{pool} {n}/{r.max_replicas.get(pool, '?')}" for pool, n in sorted(r.replicas_max.items())
    )


def row(r: LevelResult) -> list[str]:
    fleet = bool(r.replicas_max)
    return [
        f"{r.factor:g}x",
        r.variant,
        f"{r.rate_per_s:.2f}",
        str(r.offered),
        str(r.accepted),
        str(r.refused_retry_after),
        str(r.refused_other),
        str(r.no_response),
        str(r.failed_after_accept),
        secs(r.ttft_p50_s),
        secs(r.ttft_p99_s),
        ms(r.itl_p50_s),
        ms(r.itl_p99_s),
        f"{r.goodput_per_s:.2f}",
        replicas(r),
        str(r.stall_episodes) if fleet else "-",
        r.note,
    ]


def _line(cells: Sequence[str]) -> str:
    out = []
    for i, (cell, (_, width)) in enumerate(zip(cells, COLUMNS, strict=True)):
        out.append(cell.ljust(width) if i < 2 or i == len(COLUMNS) - 1 else cell.rjust(width))
    return " ".join(out).rstrip()


def level_table(mix: str, results: Sequence[LevelResult], capacity_per_s: float | None) -> str:
    """One mix, side by side: per level, a row per variant (VARIANTS order)."""
    order = {v: i for i, v in enumerate(VARIANTS)}
    ordered = sorted(results, key=lambda r: (r.factor, order.get(r.variant, len(order))))
    cap = "" if capacity_per_s is None else f", capacity {capacity_per_s:.2f} requests/s"
    header = _line([h for h, _ in COLUMNS])
    lines = [f"mix {mix}{cap}", header, "-" * len(header)]
    last = None
    for r in ordered:
        if last is not None and r.factor != last:
            lines.append("")
        lines.append(_line(row(r)))
        last = r.factor
    return "\n".join(lines)


def level_line(r: LevelResult) -> str:
    """One finished level, for the progress output."""
    extra = f" {r.note}" if r.note else ""
    fleet = f" · replicas {replicas(r)} · stalls {r.stall_episodes}" if r.replicas_max else ""
    return (
        f"{r.variant}{extra} {r.mix} {r.factor:g}x ({r.rate_per_s:.2f}/s): offered "
        f"{r.offered}, accepted {r.accepted}, refused {r.refused_retry_after} with Retry-After "
        f"+ {r.refused_other} without, no response {r.no_response}, failed after acceptance "
        f"{r.failed_after_accept} · TTFT p50 {secs(r.ttft_p50_s)} p99 {secs(r.ttft_p99_s)} · "
        f"ITL p50 {ms(r.itl_p50_s)} p99 {ms(r.itl_p99_s)} · goodput {r.goodput_per_s:.2f}/s"
        f"{fleet} · {r.elapsed_s:.0f} s"
    )


def checks_table(title: str, checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = [title]
    lines += [f"  {c.status:<4}  {c.name:<{width}}  {c.detail}" for c in checks]
    return "\n".join(lines)
