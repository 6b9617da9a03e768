"""Out-of-domain check of the shipped training procedure on subjects held out of all tuning.

The design-holdout subjects (`cascade.evaluate.design_holdout`) were never looked at
while the features and search space were chosen. Here the whole procedure (vocabulary,
length-prior multiple chosen on grouped inner folds, fit) runs on the other subjects
only; the held-out subjects are then scored, pooled and in grouped chunks, against
prompt length. The per-multiple table shows what each blend would have given (for
transparency: the choice is the inner folds', never this table's).
"""

from typing import Any

import numpy as np
from sklearn.model_selection import GroupKFold
from threadpoolctl import threadpool_limits

from cascade.adapt_eval import fit_base_on_matrix
from cascade.data import Dataset
from cascade.evaluate import design_holdout
from cascade.metrics import routing_curve
from cascade.model import TrainConfig, build_pipeline
from cascade.train import arrays_of


def check_default(dataset: Dataset, config: TrainConfig, C: float = 100.0, chunks: int = 4) -> dict:
    tune = [e for e in dataset.examples if not design_holdout(e.group)]
    held = [e for e in dataset.examples if design_holdout(e.group)]
    pipe = build_pipeline(config, C, 0.0)
    with threadpool_limits(limits=1):
        features = pipe.named_steps["features"]
        X = features.fit_transform([e.view for e in tune]).tocsr()
        X_held = features.transform([e.view for e in held]).tocsr()
        template = pipe.named_steps["clf"]
        clf = fit_base_on_matrix(
            X, tune, template, config.prior_weights, config.inner_folds, config.seed
        )
        learned = clf.lr_.decision_function(X_held) / clf.spread_
        prior = clf.prior(X_held)
    _, small, large = arrays_of(held)
    length = np.array([len(e.view.text) for e in held], dtype=float)
    scores = learned + clf.prior_weight * prior
    groups = [e.group for e in held]
    per_chunk: dict[str, list[float]] = {"classifier": [], "prompt_length": []}
    for _, te in GroupKFold(chunks).split(length, small, groups):
        per_chunk["classifier"].append(routing_curve(scores[te], small[te], large[te]).apgr())
        per_chunk["prompt_length"].append(routing_curve(length[te], small[te], large[te]).apgr())
    diff = np.array(per_chunk["classifier"]) - np.array(per_chunk["prompt_length"])
    out: dict[str, Any] = {
        "tuned_on_groups": len({e.group for e in tune}),
        "held_out_groups": sorted(set(groups)),
        "num_held_out": len(held),
        "prior_weight_chosen": float(clf.prior_weight),
        "prior_grid": list(config.prior_weights),
        "pooled": {
            "classifier": routing_curve(scores, small, large).apgr(),
            "prompt_length": routing_curve(length, small, large).apgr(),
        },
        "chunks": {
            "classifier": per_chunk["classifier"],
            "prompt_length": per_chunk["prompt_length"],
            "classifier_minus_length": {"mean": float(diff.mean()), "sd": float(diff.std())},
        },
        "pooled_by_prior_weight": {
            str(w): routing_curve(learned + w * prior, small, large).apgr()
            for w in sorted({*config.prior_weights, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0})
        },
    }
    return out
