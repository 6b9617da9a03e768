"""The difficulty classifier as one scikit-learn pipeline, its tuning, and its export.

Pipeline: `FeatureUnion(dense features -> StandardScaler, text -> TF-IDF)` then
`LengthPriorLogisticRegression`, wrapped in a sigmoid `CalibratedClassifierCV` whose
calibration folds are grouped (so probabilities are calibrated for unseen groups).

Why a length prior: on subject-grouped splits of the RouteLLM MMLU labels, almost all
of the routing signal is between subjects (within one subject no surface feature ranks
prompts better than chance), and a length coefficient *learned* from ~35 subjects
generalises worse than simply believing "longer is harder". So the decision value is
the learned logistic score (scaled to unit spread) plus a fixed multiple of the
standardised log length; the multiple is a hyperparameter chosen by inner grouped CV.

Only training imports this module; serving uses `cascade.artifact` (no scikit-learn).
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.calibration import CalibratedClassifierCV
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold, StratifiedKFold
from sklearn.pipeline import FeatureUnion, Pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from cascade.features import DENSE_FEATURE_NAMES, RequestView, dense_features, text_tokens
from cascade.metrics import routing_curve

log = logging.getLogger(__name__)

PRIOR_FEATURE = "log_chars"
_PRIOR_COLUMN = DENSE_FEATURE_NAMES.index(PRIOR_FEATURE)  # dense block comes first


@dataclass
class TrainConfig:
    """Hyperparameters and the search space of inner grouped CV."""

    c_grid: tuple[float, ...] = (10.0, 100.0)  # inverse L2 strength of the logistic model
    # Length prior multiples: the blend with prompt length, chosen on grouped folds; the
    # large ones let the tuning fall back to (almost) pure length where nothing else helps.
    prior_weights: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    dense_weight: float = 0.3  # weight of the standardised dense block against TF-IDF
    min_df: int = 2
    max_features: int = 20_000  # vocabulary size, the bulk of the artifact
    inner_folds: int = 4
    calibration_folds: int = 5
    max_iter: int = 3000
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0) -> "TrainConfig":
        """A tiny search for smoke runs and tests; not for a model you ship."""
        return cls(
            c_grid=(1.0,),
            prior_weights=(0.0, 1.0),
            inner_folds=2,
            calibration_folds=2,
            max_features=2000,
            seed=seed,
        )


@dataclass
class FittedModel:
    estimator: CalibratedClassifierCV
    params: dict[str, float]  # the chosen C and prior_weight
    tuning: list[dict[str, Any]] = field(default_factory=list)  # mean inner APGR per setting


def _texts(views: Sequence[RequestView]) -> list[str]:
    return [v.text for v in views]


def _dense(views: Sequence[RequestView]) -> np.ndarray:
    return np.array([dense_features(v) for v in views], dtype=np.float64)


class LengthPriorLogisticRegression(ClassifierMixin, BaseEstimator):
    """Logistic regression whose decision value gets a fixed length prior added.

    `decision_function(X) = lr(X) / spread + prior_weight * X[:, prior_column] / prior_scale`
    where `spread` is the standard deviation of `lr` on the training rows and
    `X[:, prior_column] / prior_scale` is the standardised log length.
    """

    def __init__(
        self,
        C: float = 1.0,
        prior_weight: float = 0.0,
        prior_column: int = 0,
        prior_scale: float = 1.0,
        max_iter: int = 3000,
    ) -> None:
        self.C = C
        self.prior_weight = prior_weight
        self.prior_column = prior_column
        self.prior_scale = prior_scale
        self.max_iter = max_iter

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> "LengthPriorLogisticRegression":
        lr = LogisticRegression(C=self.C, max_iter=self.max_iter)
        self.lr_ = lr.fit(X, y, sample_weight=sample_weight)
        self.classes_ = self.lr_.classes_
        spread = float(np.std(self.lr_.decision_function(X)))
        self.spread_ = spread if spread > 0 else 1.0
        return self

    def prior(self, X: Any) -> np.ndarray:
        col = X[:, self.prior_column]
        col = col.toarray() if hasattr(col, "toarray") else col
        return np.asarray(col, dtype=np.float64).ravel() / self.prior_scale

    def decision_function(self, X: Any) -> np.ndarray:
        return self.lr_.decision_function(X) / self.spread_ + self.prior_weight * self.prior(X)

    def predict(self, X: Any) -> np.ndarray:
        return self.classes_[(self.decision_function(X) > 0).astype(int)]


def build_pipeline(config: TrainConfig, C: float, prior_weight: float) -> Pipeline:
    """The uncalibrated pipeline over a list of `RequestView`s."""
    dense = Pipeline([("extract", FunctionTransformer(_dense)), ("scale", StandardScaler())])
    text = Pipeline(
        [
            ("extract", FunctionTransformer(_texts)),
            (
                "tfidf",
                TfidfVectorizer(
                    analyzer=text_tokens,
                    min_df=config.min_df,
                    max_features=config.max_features,
                    sublinear_tf=True,
                ),
            ),
        ]
    )
    union = FeatureUnion(
        [("dense", dense), ("text", text)],
        transformer_weights={"dense": config.dense_weight, "text": 1.0},
    )
    clf = LengthPriorLogisticRegression(
        C=C,
        prior_weight=prior_weight,
        prior_column=_PRIOR_COLUMN,
        prior_scale=config.dense_weight,
        max_iter=config.max_iter,
    )
    return Pipeline([("features", union), ("clf", clf)])


def group_splits(
    y: np.ndarray, groups: Sequence[str], n_splits: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """GroupKFold folds; stratified random folds (logged) when there are too few groups
    or a fold's training part would hold a single class."""
    idx = np.zeros(len(y))
    if len(set(groups)) >= n_splits:
        splits = list(GroupKFold(n_splits).split(idx, y, groups))
        if all(len(set(y[tr].tolist())) == 2 for tr, _ in splits):
            return splits
        log.warning("a grouped fold would train on one class: splitting at random instead")
    else:
        log.warning("only %d group(s): splitting at random instead", len(set(groups)))
    folds = StratifiedKFold(n_splits, shuffle=True, random_state=seed)
    return list(folds.split(idx, y))


def tune(
    views: Sequence[RequestView],
    y: np.ndarray,
    small_ok: np.ndarray,
    large_ok: np.ndarray,
    groups: Sequence[str],
    config: TrainConfig,
    show_progress: bool = True,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Choose C and the prior weight by mean APGR over inner grouped folds."""
    splits = group_splits(y, groups, config.inner_folds, config.seed)
    apgr: dict[tuple[float, float], list[float]] = {}
    steps = [(c, s) for c in config.c_grid for s in splits]
    for C, (tr, te) in tqdm(steps, desc="tuning", disable=not show_progress, leave=False):
        pipe = build_pipeline(config, C, 0.0).fit([views[i] for i in tr], y[tr])
        feats = pipe.named_steps["features"].transform([views[i] for i in te])
        clf: LengthPriorLogisticRegression = pipe.named_steps["clf"]
        learned = clf.lr_.decision_function(feats) / clf.spread_
        prior = clf.prior(feats)
        for w in config.prior_weights:
            curve = routing_curve(learned + w * prior, small_ok[te], large_ok[te])
            apgr.setdefault((C, w), []).append(curve.apgr())
    table = [
        {"C": c, "prior_weight": w, "inner_apgr": float(np.nanmean(v))}
        for (c, w), v in apgr.items()
    ]
    best = max(table, key=lambda r: r["inner_apgr"])
    log.info(
        "tuned on %d inner folds: C=%g prior_weight=%g (inner APGR %.3f)",
        len(splits),
        best["C"],
        best["prior_weight"],
        best["inner_apgr"],
    )
    return {"C": best["C"], "prior_weight": best["prior_weight"]}, table


def fit(
    views: Sequence[RequestView],
    y: np.ndarray,
    small_ok: np.ndarray,
    large_ok: np.ndarray,
    groups: Sequence[str],
    config: TrainConfig,
    show_progress: bool = True,
) -> FittedModel:
    """Tune, then fit the calibrated pipeline on all of `views`.

    Runs single-threaded: these problems are small, and OpenMP threads spinning on a
    shared machine made the solver some 50x slower than one thread.
    """
    if len(set(y.tolist())) < 2:
        raise ValueError("the labels are all the same: nothing to learn")
    with threadpool_limits(limits=1):
        params, table = tune(views, y, small_ok, large_ok, groups, config, show_progress)
        splits = group_splits(y, groups, config.calibration_folds, config.seed)
        pipe = build_pipeline(config, params["C"], params["prior_weight"])
        log.info("fitting on %d rows, calibrating on %d grouped folds", len(y), len(splits))
        est = CalibratedClassifierCV(pipe, method="sigmoid", cv=splits, ensemble=False)
        est.fit(list(views), y)
    return FittedModel(est, params, table)


def export_params(model: FittedModel) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The fitted model as JSON-able parameters plus named arrays (see cascade.artifact)."""
    cal = model.estimator.calibrated_classifiers_[0]
    calibrator = cal.calibrators[0]
    return export_pipeline(cal.estimator, float(calibrator.a_), float(calibrator.b_))


def export_pipeline(
    pipe: Pipeline, cal_a: float, cal_b: float
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A fitted `build_pipeline` with its sigmoid calibration `p = 1 / (1 + exp(a d + b))`
    as JSON-able parameters plus named arrays."""
    union: FeatureUnion = pipe.named_steps["features"]
    dense_weight = union.transformer_weights["dense"]
    scaler: StandardScaler = union.transformer_list[0][1].named_steps["scale"]
    tfidf: TfidfVectorizer = union.transformer_list[1][1].named_steps["tfidf"]
    clf: LengthPriorLogisticRegression = pipe.named_steps["clf"]
    num_dense = len(DENSE_FEATURE_NAMES)
    coef = clf.lr_.coef_[0]
    terms = [""] * len(tfidf.vocabulary_)
    for term, i in tfidf.vocabulary_.items():
        terms[i] = term
    params = {
        "dense_features": list(DENSE_FEATURE_NAMES),
        "dense_mean": scaler.mean_.tolist(),
        "dense_scale": scaler.scale_.tolist(),
        # weight of each standardised dense feature, the union's block weight folded in
        "dense_coef": (coef[:num_dense] * dense_weight).tolist(),
        "intercept": float(clf.lr_.intercept_[0]),
        "spread": clf.spread_,
        "prior": {"feature": PRIOR_FEATURE, "weight": float(clf.prior_weight)},
        "text": {"analyzer": "cascade.features.text_tokens", "sublinear_tf": True, "norm": "l2"},
        "vocabulary": terms,
        # p = 1 / (1 + exp(a * decision + b)), sklearn's sigmoid calibration
        "calibration": {"a": cal_a, "b": cal_b},
    }
    arrays = {
        "text_idf": np.asarray(tfidf.idf_, dtype=np.float64),
        "text_coef": np.asarray(coef[num_dense:], dtype=np.float64),
    }
    return params, arrays
