"""A tenant's own classifier: the base data plus the tenant's labels, weighted up.

Out of domain, no prompt-only router beats prompt length by more than noise; in the
tenant's own domain, its labels carry the signal (which of its topics are hard). So the
adapted classifier is the shipped model's pipeline fitted on the base rows plus the
tenant's rows, each tenant row counting `weight` times, and the weight and the length
prior's multiple are chosen on inner folds of the tenant's data only (out-of-fold APGR,
base rows always in training). Its calibration is fitted on those out-of-fold scores, so
its probabilities (and its reference scores, for target fractions) describe the
tenant's traffic, not MMLU's.

The vocabulary and scaler are fitted once on base plus tenant texts (no labels), and the
inner folds reuse that matrix; only the logistic model is refitted per fold and weight.
"""

import hashlib
import json
import logging
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold, KFold, StratifiedKFold
from sklearn.pipeline import Pipeline
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from cascade.artifact import REFERENCE_SCORES, load_artifact, write_artifact
from cascade.classifier import LengthHeuristicScorer
from cascade.data import Dataset, Example
from cascade.metrics import routing_curve
from cascade.model import (
    LengthPriorLogisticRegression,
    TrainConfig,
    build_pipeline,
    export_pipeline,
)
from cascade.train import _PARITY_TOLERANCE, arrays_of

log = logging.getLogger(__name__)


@dataclass
class AdaptConfig:
    """The search of an adapted fit. `train` holds the pipeline's own settings."""

    C: float = 100.0  # the shipped model's choice on grouped folds of the base data
    tenant_weights: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0)  # how much a tenant row counts
    prior_weights: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0)  # length prior multiples
    inner_folds: int = 3
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def quick(cls, seed: int = 0) -> "AdaptConfig":
        """A tiny search for tests and smoke runs."""
        return cls(
            C=1.0,
            tenant_weights=(1.0, 16.0),
            prior_weights=(0.0, 1.0),
            inner_folds=2,
            seed=seed,
            train=TrainConfig.quick(seed),
        )


@dataclass
class MatrixFit:
    """The outcome of the inner search on precomputed features."""

    clf: LengthPriorLogisticRegression  # fitted on base + every tenant row
    weight: float
    prior_weight: float
    oof: np.ndarray  # out-of-fold decision values of the tenant rows (chosen setting)
    tuning: list[dict[str, float]]  # out-of-fold APGR of every (weight, prior) setting


@dataclass
class AdaptedModel:
    pipe: Pipeline  # features fitted on base + tenant texts, classifier on both
    weight: float
    prior_weight: float
    cal_a: float  # p = 1 / (1 + exp(a * decision + b)), fitted on the tenant's oof
    cal_b: float
    oof_scores: np.ndarray  # calibrated out-of-fold scores of the tenant rows
    tuning: list[dict[str, float]]

    def decision(self, views: Sequence[Any]) -> np.ndarray:
        feats = self.pipe.named_steps["features"].transform(list(views))
        return self.pipe.named_steps["clf"].decision_function(feats)

    def predict_proba(self, views: Sequence[Any]) -> np.ndarray:
        return sigmoid(self.decision(views), self.cal_a, self.cal_b)


def sigmoid(decision: np.ndarray, a: float, b: float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(np.clip(a * decision + b, -700, 700)))


def platt(decision: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) of sklearn's sigmoid calibration, fitted by a 1-D logistic regression."""
    if len(set(y.tolist())) < 2:
        return -1.0, 0.0
    lr = LogisticRegression(C=1e6, max_iter=1000).fit(decision.reshape(-1, 1), y)
    return -float(lr.coef_[0, 0]), -float(lr.intercept_[0])


def tenant_splits(
    y: np.ndarray, groups: Sequence[str], n_splits: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Grouped folds when the tenant's rows name enough groups, else stratified random
    folds (plain random when a class has fewer rows than folds)."""
    idx = np.zeros(len(y))
    if len(set(groups)) >= n_splits:
        return list(GroupKFold(n_splits).split(idx, y, groups))
    if min(int(y.sum()), int(len(y) - y.sum())) >= n_splits:
        return list(StratifiedKFold(n_splits, shuffle=True, random_state=seed).split(idx, y))
    return list(KFold(n_splits, shuffle=True, random_state=seed).split(idx))


def _apgr(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> float:
    value = routing_curve(scores, small, large).apgr()
    return value if np.isfinite(value) else -np.inf


def fit_on_matrix(
    Xb: Any,
    yb: np.ndarray,
    Xt: Any,
    tenant: Sequence[Example],
    template: LengthPriorLogisticRegression,
    config: AdaptConfig,
    show_progress: bool = False,
) -> MatrixFit:
    """Choose the tenant weight and prior multiple on inner folds of the tenant rows (base
    rows always train), then fit on everything with the choice."""
    import scipy.sparse as sp

    yt, small, large = arrays_of(list(tenant))
    nb, nt = Xb.shape[0], Xt.shape[0]
    X = sp.vstack([Xb, Xt]).tocsr()
    y = np.concatenate([yb, yt])
    splits = tenant_splits(yt, [e.group for e in tenant], config.inner_folds, config.seed)
    oof = {(w, p): np.zeros(nt) for w in config.tenant_weights for p in config.prior_weights}
    steps = [(s, w) for s in splits for w in config.tenant_weights]
    for (tr, te), w in tqdm(steps, desc="adapting", disable=not show_progress, leave=False):
        rows = np.concatenate([np.arange(nb), nb + tr])
        weights = np.concatenate([np.ones(nb), np.full(len(tr), w)])
        clf = clone(template).fit(X[rows], y[rows], sample_weight=weights)
        learned = clf.lr_.decision_function(Xt[te]) / clf.spread_
        prior = clf.prior(Xt[te])
        for p in config.prior_weights:
            oof[(w, p)][te] = learned + p * prior
    tuning = [
        {"weight": w, "prior_weight": p, "oof_apgr": _apgr(v, small, large)}
        for (w, p), v in oof.items()
    ]
    best = max(tuning, key=lambda r: r["oof_apgr"])
    w, p = best["weight"], best["prior_weight"]
    clf = clone(template).set_params(prior_weight=p)
    clf.fit(X, y, sample_weight=np.concatenate([np.ones(nb), np.full(nt, w)]))
    return MatrixFit(clf, w, p, oof[(w, p)], tuning)


def fit_adapted(
    base: Sequence[Example],
    tenant: Sequence[Example],
    config: AdaptConfig | None = None,
    show_progress: bool = True,
) -> AdaptedModel:
    """Fit the tenant's classifier (see the module docstring). Raises ValueError when the
    tenant's labels are all of one class: they could not choose anything."""
    config = config or AdaptConfig()
    yt = arrays_of(list(tenant))[0]
    if len(set(yt.tolist())) < 2:
        raise ValueError("the tenant's labels are all the same: nothing to adapt to")
    yb = arrays_of(list(base))[0]
    pipe = build_pipeline(config.train, config.C, 0.0)
    with threadpool_limits(limits=1):
        views = [e.view for e in base] + [e.view for e in tenant]
        X = pipe.named_steps["features"].fit_transform(views).tocsr()
        nb = len(base)
        fitted = fit_on_matrix(
            X[:nb], yb, X[nb:], tenant, pipe.named_steps["clf"], config, show_progress
        )
    pipe.steps[-1] = ("clf", fitted.clf)
    a, b = platt(fitted.oof, yt)
    log.info(
        "adapted on %d base + %d tenant rows: weight %g, prior %g (tenant oof APGR %.3f)",
        len(base),
        len(tenant),
        fitted.weight,
        fitted.prior_weight,
        max(r["oof_apgr"] for r in fitted.tuning),
    )
    return AdaptedModel(
        pipe, fitted.weight, fitted.prior_weight, a, b, sigmoid(fitted.oof, a, b), fitted.tuning
    )


def merge_datasets(datasets: Sequence[Dataset]) -> Dataset:
    """Several base datasets as one (their hashes hashed together)."""
    if len(datasets) == 1:
        return datasets[0]
    digest = hashlib.sha256("".join(d.sha256 for d in datasets).encode()).hexdigest()
    examples = [e for d in datasets for e in d.examples]
    return Dataset(examples, " + ".join(d.source for d in datasets), digest)


def train_adapted(
    base: Dataset,
    tenant: Dataset,
    out_dir: Path,
    config: AdaptConfig | None = None,
    name: str | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Fit the tenant's classifier, write its artifact (the shipped format, pickle-free),
    return its manifest. Its reference scores are the tenant's out-of-fold scores, so a
    target fraction means a share of the tenant's own traffic."""
    import sklearn

    config = config or AdaptConfig()
    name = name or out_dir.name
    started = time.monotonic()
    model = fit_adapted(base.examples, tenant.examples, config, show_progress)
    params, arrays = export_pipeline(model.pipe, model.cal_a, model.cal_b)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REFERENCE_SCORES).unlink(missing_ok=True)
    write_artifact(out_dir, {"name": name}, params, arrays)
    scorer = load_artifact(out_dir)
    check = list(tenant.examples[:200]) + list(base.examples[:200])
    ours = np.array([scorer.score_view(e.view) for e in check])
    theirs = model.predict_proba([e.view for e in check])
    parity = float(np.max(np.abs(ours - theirs)))
    if parity > _PARITY_TOLERANCE:
        raise RuntimeError(f"exported scorer differs from scikit-learn by {parity:.3g}")
    yt, small, large = arrays_of(list(tenant.examples))
    length = LengthHeuristicScorer()
    length_scores = [length.score_view(e.view) for e in tenant.examples]
    (out_dir / REFERENCE_SCORES).write_text(
        json.dumps(
            {
                "scorer": name,
                "num_prompts": len(tenant.examples),
                "source": tenant.source,
                "note": "the tenant's labelled prompts, out-of-fold scores",
                "scores": {
                    name: [round(float(s), 6) for s in model.oof_scores],
                    length.name: length_scores,
                },
            }
        )
        + "\n",
        encoding="utf-8",
    )
    best = max(model.tuning, key=lambda r: r["oof_apgr"])
    manifest = {
        "name": name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "label": "needs_large = (not weak_ok) and strong_ok",
        "training_data": {
            "source": base.source,
            "sha256": base.sha256,
            "num_examples": len(base.examples),
            "num_groups": len(set(base.groups)),
        },
        "adaptation": {
            "source": tenant.source,
            "sha256": tenant.sha256,
            "num_labels": len(tenant.examples),
            "needs_large_rate": float(yt.mean()),
            "tenant_weight": model.weight,
            "prior_weight": model.prior_weight,
            "inner_folds": config.inner_folds,
            "tenant_oof_apgr": best["oof_apgr"],
            "tenant_prompt_length_apgr": routing_curve(
                [len(e.view.text) for e in tenant.examples], small, large
            ).apgr(),
            "tuning": model.tuning,
        },
        "versions": {
            "scikit-learn": sklearn.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "hyperparameters": {"C": config.C, "prior_weight": model.prior_weight},
        "vocabulary_size": len(params["vocabulary"]),
        "export_parity_max_abs_diff": parity,
        "train_seconds": round(time.monotonic() - started, 1),
    }
    write_artifact(out_dir, manifest, params, arrays)
    return json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))
