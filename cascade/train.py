"""Train the difficulty classifier on a labelled dataset and write its artifact.

A random reference sample (default 1,000 requests) is held out of training: its scores
become `reference_scores.json` (the traffic model for target fractions) and its
metrics go into the manifest. The rest trains the model: inner grouped CV picks the
hyperparameters, grouped folds calibrate it, and the exported pure-Python scorer is
checked against scikit-learn's own probabilities before anything is written.
"""

import json
import logging
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from cascade.artifact import REFERENCE_SCORES, load_artifact, write_artifact
from cascade.classifier import LengthHeuristicScorer
from cascade.data import Dataset, Example
from cascade.metrics import curve_summary, routing_curve
from cascade.model import TrainConfig, export_params, fit

log = logging.getLogger(__name__)

LABEL = "needs_large = (not weak_ok) and strong_ok"
_PARITY_TOLERANCE = 1e-6


def arrays_of(examples: list[Example]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(needs_large, weak_ok, strong_ok) as boolean arrays."""
    return (
        np.array([e.needs_large for e in examples], dtype=bool),
        np.array([e.weak_ok for e in examples], dtype=bool),
        np.array([e.strong_ok for e in examples], dtype=bool),
    )


def split_reference(
    examples: list[Example], num_reference: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """(training, reference): a seeded random sample of at most a fifth of the rows."""
    n = min(num_reference, len(examples) // 5)
    order = np.random.default_rng(seed).permutation(len(examples))
    ref = set(order[:n].tolist())
    train = [e for i, e in enumerate(examples) if i not in ref]
    return train, [examples[i] for i in sorted(ref)]


def ranking_metrics(scores: np.ndarray, examples: list[Example]) -> dict[str, Any]:
    """AUC of the label and the routing summary (APGR, CPTs) of one set of scores."""
    from sklearn.metrics import roc_auc_score

    y, small, large = arrays_of(examples)
    out: dict[str, Any] = curve_summary(routing_curve(scores, small, large))
    out["auc"] = float(roc_auc_score(y, scores)) if 0 < y.sum() < len(y) else None
    return out


def train_classifier(
    dataset: Dataset,
    out_dir: Path,
    config: TrainConfig | None = None,
    name: str | None = None,
    num_reference: int = 1000,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Train on `dataset`, write the artifact to `out_dir`, return its manifest."""
    import sklearn

    config = config or TrainConfig()
    name = name or out_dir.name
    started = time.monotonic()
    train, ref = split_reference(dataset.examples, num_reference, config.seed)
    y, small, large = arrays_of(train)
    views = [e.view for e in train]
    log.info(
        "training %s on %d examples (%d groups, %.1f%% need large); %d held out as reference",
        name,
        len(train),
        len({e.group for e in train}),
        100 * y.mean(),
        len(ref),
    )
    model = fit(views, y, small, large, [e.group for e in train], config, show_progress)
    params, arrays = export_params(model)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REFERENCE_SCORES).unlink(missing_ok=True)
    write_artifact(out_dir, {"name": name}, params, arrays)  # provisional, for the check
    scorer = load_artifact(out_dir)
    check = train[:200] + ref
    ours = np.array([scorer.score_view(e.view) for e in check])
    theirs = model.estimator.predict_proba([e.view for e in check])[:, 1]
    parity = float(np.max(np.abs(ours - theirs)))
    if parity > _PARITY_TOLERANCE:
        raise RuntimeError(f"exported scorer differs from scikit-learn by {parity:.3g}")

    metrics: dict[str, Any] = {"inner_grouped_cv_apgr": max(r["inner_apgr"] for r in model.tuning)}
    ref_scores: list[float] = []
    if ref:
        ref_scores = ours[-len(ref) :].tolist()
        length = LengthHeuristicScorer()
        length_scores = [length.score_view(e.view) for e in ref]
        metrics["reference_sample"] = {
            "note": "random held-out sample: subjects seen in training (optimistic)",
            "classifier": ranking_metrics(np.array(ref_scores), ref),
            "prompt_length": ranking_metrics(np.array(length_scores), ref),
        }
        reference = {
            "scorer": name,
            "num_prompts": len(ref),
            "source": dataset.source,
            "training_data_sha256": dataset.sha256,
            "scores": {name: [round(s, 6) for s in ref_scores], length.name: length_scores},
        }
        (out_dir / REFERENCE_SCORES).write_text(json.dumps(reference) + "\n", encoding="utf-8")

    manifest = {
        "name": name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "label": LABEL,
        "training_data": {
            "source": dataset.source,
            "sha256": dataset.sha256,
            "num_examples": len(dataset.examples),
            "num_trained_on": len(train),
            "num_reference": len(ref),
            "num_groups": len(set(dataset.groups)),
            "needs_large_rate": float(y.mean()),
        },
        "versions": {
            "scikit-learn": sklearn.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "config": asdict(config),
        "hyperparameters": model.params,
        "tuning": model.tuning,
        "vocabulary_size": len(params["vocabulary"]),
        "export_parity_max_abs_diff": parity,
        "metrics": metrics,
        "train_seconds": round(time.monotonic() - started, 1),
    }
    write_artifact(out_dir, manifest, params, arrays)
    log.info(
        "wrote %s: %d terms, C=%g, prior_weight=%g, parity %.1e, %.0f s",
        out_dir,
        len(params["vocabulary"]),
        model.params["C"],
        model.params["prior_weight"],
        parity,
        manifest["train_seconds"],
    )
    return json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))
