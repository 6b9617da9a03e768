"""The SLO bench's results: the checks, the JSON report, the printed summary."""

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.slo.levels import LevelResult, count_over_max, count_stall_episodes, fleet_extent
from benchmarks.slo.run import Run
from benchmarks.slo.tables import checks_table, level_table
from benchmarks.slo.verdict import Check, fleet_checks, mix_checks


def all_checks(run: Run) -> dict[str, list[Check]]:
    out: dict[str, list[Check]] = {}
    ours = run.results.get("switchyard", {})
    skip = run.opts.skip
    for name in run.opts.mixes:
        out[name] = mix_checks(
            ours.get(name, []),
            run.targets,
            run.default,
            oracle=run.results.get("oracle", {}).get(name),
            llama=run.results.get("llama-server", {}).get(name),
            why_no_oracle="skipped" if "oracle" in skip else run.errors.get("oracle", "failed"),
            why_no_llama="skipped" if "llama" in skip else run.errors.get("llama-server", "failed"),
        )
    samples = run.fleet.get("switchyard", [])
    seen, limit = fleet_extent(samples)
    out["fleet"] = fleet_checks(
        count_stall_episodes(samples), count_over_max(samples), seen, limit, len(samples)
    )
    return out


def report(run: Run, checks: dict[str, list[Check]] | None) -> dict[str, Any]:
    def level(variant: str, mix: str, i: int, r: LevelResult) -> dict:
        doc = asdict(r)
        mine = run.outcomes.get(variant, {}).get(mix, [])
        if i < len(mine):
            doc["outcomes"] = mine[i]  # every request, as the client saw it
        return doc

    opts = {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(run.opts).items()}
    return {
        "options": json.loads(json.dumps(opts, default=str)),
        "targets": {p: asdict(t) for p, t in run.targets.items()},
        "itl_rule": run.opts.itl_rule,
        "capacity": run.capacity,
        "levels": {m: [asdict(lv) for lv in lvs] for m, lvs in run.levels.items()},
        "variants": {
            v: {m: [level(v, m, i, r) for i, r in enumerate(rs)] for m, rs in mixes.items()}
            for v, mixes in run.results.items()
        },
        "oracle_by_seqs": {
            str(s): {m: [asdict(r) for r in rs] for m, rs in mixes.items()}
            for s, mixes in run.by_seqs.items()
        },
        "fleet_samples": run.fleet,
        "guidellm": run.guidellm,
        "errors": run.errors,
        "checks": {k: [asdict(c) for c in cs] for k, cs in (checks or {}).items()},
        "work_dir": str(run.work_dir),
    }


def write(run: Run, checks: dict[str, list[Check]] | None = None) -> None:
    if run.opts.out is None:
        return
    out = Path(run.opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report(run, checks), indent=1) + "\n")


_HTTP_ERROR = re.compile(r"(?:Server|Client) error '(\d{3})")


def error_statuses(report: Any) -> dict[str, int]:
    """How many of a GuideLLM report's errored requests were HTTP answers, per status:
    every `"error"` string of the form httpx raises (`Server error '503 ...'`)."""
    counts: dict[str, int] = {}
    stack = [report]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            error = node.get("error")
            match = _HTTP_ERROR.search(error) if isinstance(error, str) else None
            if match:
                counts[match.group(1)] = counts.get(match.group(1), 0) + 1
            stack.extend(v for k, v in node.items() if k != "error")
        elif isinstance(node, list):
            stack.extend(node)
    return dict(sorted(counts.items()))


def summary(run: Run, checks: dict[str, list[Check]]) -> str:
    from benchmarks.peers.guidellm import GuideLLMLevel, format_table

    parts = []
    for name in run.opts.mixes:
        rows = [r for mixes in run.results.values() for r in mixes.get(name, [])]
        cap = run.capacity.get(name, {}).get("requests_per_s")
        parts.append(level_table(name, rows, cap))
    g = run.guidellm
    if g is not None:
        head = f"GuideLLM sweep against our stack ({run.opts.guidellm_data}, model auto)"
        if "error" in g:
            parts.append(f"{head}: failed: {g['error']}")
        else:
            levels = [
                GuideLLMLevel(**{k: v for k, v in lv.items() if k != "label"}) for lv in g["levels"]
            ]
            statuses = ", ".join(f"{n} HTTP {code}" for code, n in g["error_statuses"].items())
            why = "GuideLLM counts refusals as errors and does not wait out Retry-After"
            parts.append(
                f"{head}\nerrored requests: {g['num_errored']}"
                + (f" ({statuses}; {why})" if statuses else "")
                + f"; GuideLLM exits 0 even when requests fail\n{format_table(levels)}"
            )
    for key, cs in checks.items():
        title = "fleet, over our stack's whole run" if key == "fleet" else f"targets, mix {key}"
        parts.append(checks_table(title, cs))
    for key, err in run.errors.items():
        parts.append(f"error ({key}): {err}")
    return "\n\n".join(parts)
