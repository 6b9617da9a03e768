"""Write an evaluation report: `report.json`, `report.md` and `curve.png`."""

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_LABELS = {
    "classifier": "classifier",
    "prompt_length": "prompt length",
    "random": "random",
    "oracle": "oracle",
}
_STYLE = {
    "classifier": {"color": "C0", "lw": 2.0},
    "prompt_length": {"color": "C1", "lw": 1.5},
    "random": {"color": "grey", "lw": 1.0, "ls": "--"},
    "oracle": {"color": "C2", "lw": 1.0, "ls": ":"},
}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ms(stat: dict[str, float | None], percent: bool = False) -> str:
    mean, std = stat["mean"], stat["std"] or 0.0
    if mean is None:
        return "n/a"
    if percent:
        return f"{100 * mean:.1f}% ± {100 * std:.1f}"
    return f"{mean:.3f} ± {std:.3f}"


def plot_curves(report: dict[str, Any], path: Path) -> None:
    """Quality vs % of requests sent large, one panel per protocol (pooled out-of-fold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = report["protocols"]
    fig, axes = plt.subplots(1, len(protocols), figsize=(6.5 * len(protocols), 5), squeeze=False)
    for ax, (kind, proto) in zip(axes[0], protocols.items(), strict=True):
        curves = proto["pooled_curves"]
        x = [100 * f for f in curves["fraction_large"]]
        for router, label in _LABELS.items():
            apgr = proto["pooled"][router]["apgr"]
            ax.plot(
                x,
                [100 * q for q in curves[router]],
                label=f"{label} (APGR {apgr:.3f})",
                **_STYLE[router],
            )
        small = proto["pooled"]["random"]["small_quality"]
        large = proto["pooled"]["random"]["large_quality"]
        ax.scatter([0], [100 * small], marker="s", color="C3", zorder=5, label="always small")
        ax.scatter([100], [100 * large], marker="^", color="C4", zorder=5, label="always large")
        ax.set_xlim(0, 100)
        ax.set_xlabel("requests sent to the large model (%)")
        ax.set_ylabel("quality: answered correctly (%)")
        ax.set_title(f"{kind} {proto['num_folds']}-fold CV, pooled out-of-fold scores")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _compare(clf: float, length: float) -> str:
    if abs(clf - length) < 0.0005:
        return "only matches"
    return "beats" if clf > length else "does NOT beat"


def _paired(proto: dict[str, Any]) -> tuple[float, float]:
    """Mean and standard error of the per-fold APGR difference, classifier - length."""
    diffs = [
        f["routers"]["classifier"]["apgr"] - f["routers"]["prompt_length"]["apgr"]
        for f in proto["folds"]
    ]
    if len(diffs) < 2:
        return (diffs[0] if diffs else 0.0), float("nan")
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, (var / len(diffs)) ** 0.5


def _verdict(report: dict[str, Any]) -> list[str]:
    lines = []
    for kind, proto in report["protocols"].items():
        m = proto["mean_over_folds"]
        c, p = m["classifier"]["apgr"]["mean"], m["prompt_length"]["apgr"]["mean"]
        wins = proto["classifier_beats_length_in_folds"]
        diff, se = _paired(proto)
        if abs(diff) >= 2 * se:
            verb, noise = ("beats" if diff > 0 else "is worse than"), "over twice its s.e."
        else:
            verb = "is not clearly better than" if diff > 0 else "is not clearly worse than"
            noise = "within fold-to-fold noise"
        lines.append(
            f"- **{kind}** folds: the classifier {verb} prompt length: mean APGR "
            f"{c:.3f} vs {p:.3f}, higher in {wins} of {proto['num_folds']} folds, paired "
            f"difference {diff:+.3f} (s.e. {se:.3f}, {noise}). Pooled out-of-fold: "
            f"{proto['pooled']['classifier']['apgr']:.3f} vs "
            f"{proto['pooled']['prompt_length']['apgr']:.3f}."
        )
    sub = report.get("subsets", {}).get("design_holdout_groups")
    if sub:
        c = sub["pooled"]["classifier"]["apgr"]
        p = sub["pooled"]["prompt_length"]["apgr"]
        lines.append(
            f"- On the {len(sub['groups'])} groups never looked at during feature design "
            f"(grouped out-of-fold scores), the classifier {_compare(c, p)} prompt length: "
            f"APGR {c:.3f} vs {p:.3f}."
        )
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    d = report["dataset"]
    out = [
        "# Difficulty classifier: cost-quality evaluation",
        "",
        f"Data: `{d['source']}` (sha256 `{d['sha256'][:16]}…`), {d['num_examples']} requests "
        f"in {d['num_groups']} groups. Small model correct {_pct(d['small_accuracy'])}, "
        f"large {_pct(d['large_accuracy'])}; label *needs large* (small wrong, large right) "
        f"{_pct(d['needs_large_rate'])}.",
        "",
        "## Verdict",
        "",
        *_verdict(report),
        "",
        "## Results (mean ± std over test folds)",
        "",
        "APGR: area under performance-gap-recovered vs fraction of large calls (random 0.5; "
        "the oracle exceeds 1 because the small model is right on some questions the large "
        "one misses). CPT(x): least fraction of large calls that recovers x of the gap.",
        "",
        "| protocol | router | APGR | CPT(50%) | CPT(80%) | pooled APGR |",
        "|---|---|---|---|---|---|",
    ]
    for kind, proto in report["protocols"].items():
        for r, label in _LABELS.items():
            m = proto["mean_over_folds"][r]
            out.append(
                f"| {kind} | {label} | {_ms(m['apgr'])} | {_ms(m['cpt50'], True)} | "
                f"{_ms(m['cpt80'], True)} | {proto['pooled'][r]['apgr']:.3f} |"
            )
    out += ["", "![cost-quality curves](curve.png)", ""]
    sub = report.get("subsets", {})
    if "design_holdout_groups" in sub:
        s = sub["design_holdout_groups"]
        out += [
            "## Groups held out of feature design",
            "",
            f"{', '.join(s['groups'])} ({s['num_examples']} requests), grouped out-of-fold:",
            "",
            "| router | APGR | CPT(50%) | CPT(80%) |",
            "|---|---|---|---|",
        ]
        for r, label in _LABELS.items():
            p = s["pooled"][r]
            out.append(f"| {label} | {p['apgr']:.3f} | {_pct(p['cpt50'])} | {_pct(p['cpt80'])} |")
        out.append("")
    if "per_group" in sub:
        pg = sub["per_group"]
        out += [
            "## Where the signal is",
            "",
            "Spearman correlation, across groups, of the true needs-large rate with the mean "
            f"held-out classifier score: {pg['spearman_rate_vs_mean_score']:.2f}; with the "
            f"mean prompt length: {pg['spearman_rate_vs_mean_length']:.2f}.",
            "",
        ]
    out += ["## Calibration (out-of-fold scores)", ""]
    for kind, proto in report["protocols"].items():
        c = proto["calibration"]
        out.append(
            f"- {kind}: Brier {c['brier']:.4f}, log loss {c['log_loss']:.4f}, ECE "
            f"{c['ece_10_bins']:.4f}, mean score {c['mean_score']:.3f} vs rate "
            f"{c['needs_large_rate']:.3f}"
        )
    out += [
        "",
        "## Folds",
        "",
        "| protocol | fold | test groups | n | C | prior | APGR clf | APGR length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, proto in report["protocols"].items():
        for i, f in enumerate(proto["folds"], 1):
            groups = ", ".join(f["test_groups"]) if kind == "grouped" else "random"
            hp = f["hyperparameters"]
            out.append(
                f"| {kind} | {i} | {groups} | {f['num_test']} | {hp['C']:g} | "
                f"{hp['prior_weight']:g} | {f['routers']['classifier']['apgr']:.3f} | "
                f"{f['routers']['prompt_length']['apgr']:.3f} |"
            )
    runs = report.get("latency") or {}
    if runs:
        out += [
            "",
            "## Scoring latency (one core, one thread)",
            "",
            "| prompts | scorer | n | mean chars | p50 ms | p90 ms | p99 ms | max ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, lat in runs.items():
            out.append(
                f"| {label} | `{lat['scorer']}` | {lat['num_prompts']} | "
                f"{lat['mean_prompt_chars']:.0f} | {lat['p50_ms']:.3f} | {lat['p90_ms']:.3f} | "
                f"{lat['p99_ms']:.3f} | {lat['max_ms']:.3f} |"
            )
        out.append(f"\n{next(iter(runs.values()))['cpu']}.")
    notes = report.get("notes")
    if notes:
        out += ["", "## Method", "", *notes]
    return "\n".join(out) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")
    plot_curves(report, out_dir / "curve.png")
    log.info("wrote report.json, report.md and curve.png to %s", out_dir)
