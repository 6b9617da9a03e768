"""Labels from traffic (judges, held-out split, export rows) and the adapted classifier."""

from pathlib import Path

import numpy as np
import pytest

from cascade.adapt import AdaptConfig, fit_adapted, train_adapted
from cascade.artifact import load_artifact
from cascade.classifier import load_reference_scores
from cascade.data import load_dataset
from cascade.labels import (
    Label,
    answers_agree,
    builtin_verdict,
    confident,
    exact_match,
    final_answer,
    is_holdout,
    merge_labels,
    training_rows,
)
from tests.unit.cascade.conftest import synthetic_rows, write_csv


def label(rid: str, source: str = "shadow", weak_ok: bool | None = True, t: float = 0.0) -> Label:
    return Label(
        tenant="acme",
        request_id=rid,
        source=source,
        weak_ok=weak_ok,
        strong_ok=True,
        served_pool="small",
        features=[0.0],
        time=t,
    )


def test_final_answer_finds_the_choice_letter_else_the_last_number() -> None:
    assert final_answer("The answer is (C).") == "C"
    assert final_answer("B. because of the second law") == "B"
    assert final_answer("Let me think... so the total is 1,250 apples") == "1250"
    assert final_answer("x = 2.50") == "2.5"
    assert final_answer("I am not sure") is None


def test_judges_compare_the_small_answer_with_the_large_one() -> None:
    assert exact_match("  Paris. ", "paris")
    assert not exact_match("Paris", "Lyon")
    assert answers_agree("I think the answer is (B)", "Answer: B")
    assert not answers_agree("Answer: A", "Answer: B")
    assert answers_agree("hello there", "Hello there!")  # nothing to extract: exact match
    assert confident([-0.1, -0.2], -1.0, -6.0) is True
    assert confident([-0.1, -7.0], -1.0, -6.0) is False
    assert confident([], -1.0, -6.0) is None
    assert builtin_verdict("final_answer", "(A)", "(B)") is False
    with pytest.raises(ValueError):
        builtin_verdict("vibes", "a", "b")


def test_holdout_split_is_deterministic_and_about_a_fifth() -> None:
    ids = [f"gw-{i}" for i in range(5000)]
    held = [is_holdout(r) for r in ids]
    assert held == [is_holdout(r) for r in ids]
    assert 0.17 < sum(held) / len(ids) < 0.23


def test_feedback_overrides_shadow_and_rows_need_text_and_a_known_outcome() -> None:
    ids = [r for r in (f"gw-{i}" for i in range(100)) if not is_holdout(r)][:4]
    labels = [
        label(ids[0], "shadow", True, 1.0),
        label(ids[0], "feedback", False, 0.5),  # older, but the more direct source
        label(ids[1], "feedback", None),  # a large answer's feedback: small unknown
        label(ids[2]),  # no text kept
        label(ids[3], "escalation", False),
    ]
    assert [m.source for m in merge_labels(labels)] == [
        "feedback",
        "feedback",
        "shadow",
        "escalation",
    ]
    prompts = {ids[0]: {"prompt": "q0"}, ids[1]: {"prompt": "q1"}, ids[3]: {"messages": []}}
    rows, skipped = training_rows(labels, prompts, "train")
    assert [(r.get("prompt"), r["weak_ok"]) for r in rows] == [("q0", False), (None, False)]
    assert skipped == {"no_prompt": 1, "unknown_outcome": 1, "other_split": 0}
    assert training_rows(labels, prompts, "holdout")[1]["other_split"] == 4


def test_adapted_classifier_learns_the_tenants_rule_and_exports_exactly(tmp_path: Path) -> None:
    base = load_dataset(write_csv(tmp_path / "base.csv", synthetic_rows(240)))
    # The tenant's rule is a topic the base data never ties to difficulty: "zebra" is hard.
    rng = np.random.default_rng(0)
    rows = []
    for i in range(160):
        hard = i % 2 == 0
        words = " ".join(rng.choice(["cell", "value", "market", "court"], size=rng.integers(5, 30)))
        rows.append(
            {
                "prompt": f"{'zebra' if hard else 'giraffe'} {words}",
                "weak_ok": not hard,
                "strong_ok": True,
                "group": "acme",
            }
        )
    tenant = load_dataset(write_csv(tmp_path / "tenant.csv", rows))
    model = fit_adapted(base.examples, tenant.examples, AdaptConfig.quick(), show_progress=False)
    p = model.predict_proba([e.view for e in tenant.examples])
    hard = np.array([r["prompt"].startswith("zebra") for r in rows])
    assert p[hard].min() > p[~hard].max()
    manifest = train_adapted(base, tenant, tmp_path / "acme", AdaptConfig.quick(), "acme-1")
    assert manifest["adaptation"]["num_labels"] == 160
    assert manifest["export_parity_max_abs_diff"] < 1e-6
    scorer = load_artifact(tmp_path / "acme")
    assert scorer.score("zebra cell value") > scorer.score("giraffe cell value")
    assert len(load_reference_scores(tmp_path / "acme")) == 160


def test_adapting_to_labels_of_one_outcome_is_refused(tmp_path: Path) -> None:
    base = load_dataset(write_csv(tmp_path / "base.csv", synthetic_rows(120)))
    rows = [
        {"prompt": f"q {i}", "weak_ok": True, "strong_ok": True, "group": "t"} for i in range(20)
    ]
    tenant = load_dataset(write_csv(tmp_path / "t.csv", rows))
    with pytest.raises(ValueError, match="all the same"):
        fit_adapted(base.examples, tenant.examples, AdaptConfig.quick(), show_progress=False)
