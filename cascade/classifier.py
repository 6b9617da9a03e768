"""The difficulty scorer the gateway calls, and how it is loaded.

`load_scorer()` serves the shipped artifact (`DEFAULT_ARTIFACT`). When an artifact is
missing, corrupt, or built for another feature version, it logs a warning and returns
the length heuristic with `fell_back=True`, so the caller can count fallbacks (a metric)
and mark routed responses `x-switchyard-route: fallback`. It never raises for a bad
artifact: routing degrades, serving goes on.
"""

import json
import logging
import math
from pathlib import Path
from typing import Protocol, runtime_checkable

from cascade.artifact import REFERENCE_SCORES, ArtifactError, load_artifact
from cascade.features import RequestView, request_view

log = logging.getLogger(__name__)

DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "difficulty-v1"

# Logistic fit of the RouteLLM MMLU label (weak wrong, strong right) on log1p(chars):
# a calibrated probability that only knows the prompt's length (about 0.11..0.32).
_LENGTH_SLOPE = 0.2785
_LENGTH_INTERCEPT = -3.1337


@runtime_checkable
class DifficultyScorer(Protocol):
    """Scores a request: the probability that it needs the large model."""

    name: str  # e.g. "difficulty-v1" or "length-heuristic"

    def score(
        self, prompt: str, messages: list[dict] | None = None, max_tokens: int | None = None
    ) -> float:
        """P(needs large), 0..1. With `messages` (chat), `prompt` is ignored."""
        ...

    def explain(
        self,
        prompt: str,
        messages: list[dict] | None = None,
        max_tokens: int | None = None,
        top: int = 5,
    ) -> list[tuple[str, float]]:
        """Top feature contributions (name, signed logit contribution), for a debug log."""
        ...


class LengthHeuristicScorer:
    """The fallback: a logistic function of log1p(characters of the request's text)."""

    name = "length-heuristic"

    def score(
        self, prompt: str, messages: list[dict] | None = None, max_tokens: int | None = None
    ) -> float:
        return self.score_view(request_view(prompt, messages, max_tokens))

    def score_view(self, view: RequestView) -> float:
        logit = _LENGTH_SLOPE * math.log1p(len(view.text)) + _LENGTH_INTERCEPT
        return 1.0 / (1.0 + math.exp(-logit))

    def explain(
        self,
        prompt: str,
        messages: list[dict] | None = None,
        max_tokens: int | None = None,
        top: int = 5,
    ) -> list[tuple[str, float]]:
        chars = len(request_view(prompt, messages).text)
        return [("length:log_chars", round(_LENGTH_SLOPE * math.log1p(chars), 4))][:top]


def load_scorer(path: str | Path | None = None) -> tuple[DifficultyScorer, bool]:
    """(scorer, fell_back). `path` None: the shipped artifact, `DEFAULT_ARTIFACT`."""
    root = Path(path) if path is not None else DEFAULT_ARTIFACT
    try:
        scorer = load_artifact(root)
    except ArtifactError as exc:
        log.warning("difficulty classifier not loaded, falling back to prompt length: %s", exc)
        return LengthHeuristicScorer(), True
    log.info("difficulty classifier %s loaded from %s", scorer.name, root)
    return scorer, False


def load_reference_scores(
    path: str | Path | None = None, scorer_name: str | None = None
) -> list[float]:
    """Scores of the artifact's held-out reference sample, for target-fraction thresholds.

    `path` is the artifact directory (None: the shipped one) or the JSON file itself.
    `scorer_name` picks whose scores: the classifier's (default) or, for a scorer that
    fell back, "length-heuristic" (the same prompts scored by `LengthHeuristicScorer`).
    Raises `ArtifactError` when the file is missing or has no such scores.
    """
    root = Path(path) if path is not None else DEFAULT_ARTIFACT
    file = root / REFERENCE_SCORES if root.is_dir() else root
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        table = raw["scores"]
        return [float(x) for x in table[scorer_name or raw["scorer"]]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(
            f"no reference scores for {scorer_name or 'the classifier'}", file
        ) from exc
