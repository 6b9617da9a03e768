"""Latency summaries and the markdown/JSON report of a benchmark run."""

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(ttft_s: Sequence[float], itl_s: Sequence[float]) -> dict[str, float]:
    return {
        "ttft_p50_ms": percentile(ttft_s, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft_s, 99) * 1e3,
        "itl_p50_ms": percentile(itl_s, 50) * 1e3,
        "itl_p99_ms": percentile(itl_s, 99) * 1e3,
    }


# Columns shared by every table of streaming latency: (result key, header).
LATENCY_COLUMNS = [
    ("tokens_per_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
]


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A markdown table of `rows`; columns are (key, header) pairs."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k, "")) for k, _ in columns) + " |")
    return "\n".join(lines)


def write_report(
    out_dir: Path, name: str, data: dict[str, Any], markdown: str
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    md_path = out_dir / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str))
    md_path.write_text(markdown + "\n")
    return json_path, md_path
