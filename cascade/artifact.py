"""The classifier artifact on disk, and the scorer that serves it without scikit-learn.

A directory holding:
- `manifest.json`: format, name, feature version, training-data hash, library versions,
  hyperparameters, metrics, and the sha256 of every other file;
- `model.json`: scaler, coefficients, calibration and the vocabulary (terms in column
  order), as written by `cascade.model.export_params`;
- `text_idf.npy`, `text_coef.npy`: float64 arrays, read with `allow_pickle=False`;
- `reference_scores.json` (optional): scores of a held-out reference sample.

Nothing is pickled, so loading an artifact cannot run code. `load_artifact` raises
`ArtifactError` on any mismatch; `cascade.classifier.load_scorer` turns that into the
length-heuristic fallback.
"""

import hashlib
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from cascade.features import (
    DENSE_FEATURE_NAMES,
    FEATURE_VERSION,
    RequestView,
    analyze,
    request_view,
)

ARTIFACT_FORMAT = "switchyard-difficulty/1"
MANIFEST = "manifest.json"
MODEL = "model.json"
ARRAYS = ("text_idf", "text_coef")
REFERENCE_SCORES = "reference_scores.json"


class ArtifactError(Exception):
    """An artifact that cannot be served: missing file, bad hash, version mismatch."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_artifact(
    out_dir: Path, manifest: dict[str, Any], params: dict[str, Any], arrays: dict[str, np.ndarray]
) -> None:
    """Write model, arrays and manifest (last, with the other files' hashes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODEL).write_text(json.dumps(params, separators=(",", ":")), encoding="utf-8")
    for name in ARRAYS:
        np.save(out_dir / f"{name}.npy", arrays[name], allow_pickle=False)
    files = [MODEL] + [f"{n}.npy" for n in ARRAYS]
    if (out_dir / REFERENCE_SCORES).is_file():
        files.append(REFERENCE_SCORES)
    manifest = {
        **manifest,
        "format": ARTIFACT_FORMAT,
        "feature_version": FEATURE_VERSION,
        "files": {f: sha256_file(out_dir / f) for f in files},
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read {MANIFEST}: {exc}", path) from exc
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{MANIFEST} is not an object", path)
    return manifest


def load_artifact(path: str | Path) -> "LinearDifficultyScorer":
    """Check the manifest (format, feature version, file hashes) and build the scorer."""
    root = Path(path)
    manifest = read_manifest(root)
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"format {manifest.get('format')!r} != {ARTIFACT_FORMAT!r}", root)
    if manifest.get("feature_version") != FEATURE_VERSION:
        raise ArtifactError(
            f"feature version {manifest.get('feature_version')!r} != this code's "
            f"{FEATURE_VERSION!r}; retrain with `switchyard cascade train`",
            root,
        )
    for name, digest in (manifest.get("files") or {}).items():
        file = root / name
        if not file.is_file() or sha256_file(file) != digest:
            raise ArtifactError(f"{name} is missing or does not match the manifest", root)
    try:
        params = json.loads((root / MODEL).read_text(encoding="utf-8"))
        arrays = {n: np.load(root / f"{n}.npy", allow_pickle=False) for n in ARRAYS}
        return LinearDifficultyScorer(str(manifest.get("name", root.name)), params, arrays)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"cannot load the model: {exc}", root) from exc


class LinearDifficultyScorer:
    """Serves an exported classifier with plain Python arithmetic (about 0.1 ms a prompt).

    score = sigmoid calibration of `(text . w + dense . v + b) / spread + prior * z_len`.
    """

    def __init__(self, name: str, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        if tuple(params["dense_features"]) != DENSE_FEATURE_NAMES:
            raise ValueError("dense feature names differ from this code's")
        terms: list[str] = params["vocabulary"]
        idf, coef = arrays["text_idf"], arrays["text_coef"]
        if not (len(terms) == idf.shape[0] == coef.shape[0]):
            raise ValueError("vocabulary, idf and coefficients differ in length")
        self.name = name
        self._terms = {t: (float(i), float(c)) for t, i, c in zip(terms, idf, coef, strict=True)}
        self._mean = [float(x) for x in params["dense_mean"]]
        self._scale = [float(x) for x in params["dense_scale"]]
        self._dense_coef = [float(x) for x in params["dense_coef"]]
        self._intercept = float(params["intercept"])
        self._spread = float(params["spread"])
        self._prior_index = DENSE_FEATURE_NAMES.index(params["prior"]["feature"])
        self._prior_weight = float(params["prior"]["weight"])
        self._cal_a = float(params["calibration"]["a"])
        self._cal_b = float(params["calibration"]["b"])

    def _contributions(self, view: RequestView) -> tuple[dict[str, float], float]:
        """Per-feature terms of the decision value (before calibration), and the total."""
        dense, tokens = analyze(view)
        counts = Counter(filter(self._terms.__contains__, tokens))
        weights = {t: (1.0 + math.log(n)) * self._terms[t][0] for t, n in counts.items()}
        norm = math.sqrt(sum(v * v for v in weights.values())) or 1.0
        parts = {
            f"text:{t}": v / norm * self._terms[t][1] / self._spread for t, v in weights.items()
        }
        z = [(x - m) / s for x, m, s in zip(dense, self._mean, self._scale, strict=True)]
        for name, zj, cj in zip(DENSE_FEATURE_NAMES, z, self._dense_coef, strict=True):
            parts[f"dense:{name}"] = zj * cj / self._spread
        prior_name = DENSE_FEATURE_NAMES[self._prior_index]
        parts[f"prior:{prior_name}"] = self._prior_weight * z[self._prior_index]
        total = sum(parts.values()) + self._intercept / self._spread
        return parts, total

    def _decision(self, view: RequestView) -> float:
        dense, tokens = analyze(view)
        counts = Counter(filter(self._terms.__contains__, tokens))
        dot = norm_sq = 0.0
        for term, n in counts.items():
            idf, coef = self._terms[term]
            v = (1.0 + math.log(n)) * idf
            norm_sq += v * v
            dot += v * coef
        text = dot / math.sqrt(norm_sq) if norm_sq else 0.0
        z = [(x - m) / s for x, m, s in zip(dense, self._mean, self._scale, strict=True)]
        dense_part = sum(zj * cj for zj, cj in zip(z, self._dense_coef, strict=True))
        learned = (text + dense_part + self._intercept) / self._spread
        return learned + self._prior_weight * z[self._prior_index]

    def _probability(self, decision: float) -> float:
        x = self._cal_a * decision + self._cal_b
        return 1.0 / (1.0 + math.exp(x)) if x < 700 else 0.0

    def score(
        self, prompt: str, messages: list[dict] | None = None, max_tokens: int | None = None
    ) -> float:
        """P(the request needs the large model), 0..1."""
        return self.score_view(request_view(prompt, messages, max_tokens))

    def score_view(self, view: RequestView) -> float:
        """`score` of an already normalised request."""
        return self._probability(self._decision(view))

    def explain(
        self,
        prompt: str,
        messages: list[dict] | None = None,
        max_tokens: int | None = None,
        top: int = 5,
    ) -> list[tuple[str, float]]:
        """The `top` largest signed contributions to the score's log-odds.

        Names are `text:<term>`, `dense:<feature>` and `prior:log_chars`; the values
        are on the calibrated logit scale, so they add up (with the intercept) to
        `log(score / (1 - score))`.
        """
        parts, _ = self._contributions(request_view(prompt, messages, max_tokens))
        ranked = sorted(parts.items(), key=lambda kv: abs(kv[1]), reverse=True)
        return [(k, round(-self._cal_a * v, 4)) for k, v in ranked[:top]]
