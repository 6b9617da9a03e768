"""Routing labels from live traffic, as pure data: the record, the built-in judges, the
held-out split, and the rows `switchyard cascade train --adapt` reads.

Where a label comes from (`source`):
- `shadow`: an `auto` request was also run on the other pool, off the response path; a
  judge compared the small answer with the large one (the reference: `strong_ok` True).
- `escalation`: the small answer was unsure and the large pool answered again; the same
  judge decides whether the small answer was good enough after all.
- `feedback`: the application said later whether the answer it got was `ok`.

A label never holds prompt text: it holds the dense features of the request. The text is
kept beside it (with a retention period) only for tenants that opted in, and only labels
whose text is still there can train a text classifier. Nothing here does I/O; the gateway
stores labels in a bounded per-tenant Redis stream (`gateway/learning/label_store.py`).
"""

import hashlib
import math
import re
from collections.abc import Iterable, Sequence

import msgspec

from cascade.features import FEATURE_VERSION, RequestView, dense_features

SOURCES = ("shadow", "escalation", "feedback")
JUDGES = ("exact", "final_answer", "confidence", "http")
HOLDOUT_FRACTION = 0.2  # of request ids: never trained on, the promotion check's labels


class Label(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One routing label. `weak_ok` / `strong_ok`: whether the small / large model's answer
    was good enough; None when unknown (a feedback on a large answer says nothing of the
    small one). Token counts are the completion tokens of each pool's answer."""

    tenant: str
    request_id: str
    source: str  # one of SOURCES
    weak_ok: bool | None
    strong_ok: bool | None
    served_pool: str  # the pool whose answer the client got
    features: list[float]  # dense_features of the request (DENSE_FEATURE_NAMES order)
    feature_version: str = FEATURE_VERSION
    judge: str | None = None  # which judge decided (shadow, escalation)
    score: float | None = None  # the routing score when it was served
    small_tokens: int | None = None
    large_tokens: int | None = None
    feedback_score: float | None = None  # the optional score of a feedback
    time: float = 0.0  # unix seconds

    @property
    def needs_large(self) -> bool | None:
        """The classifier's label; None when the small model's outcome is unknown."""
        if self.weak_ok is None:
            return None
        return (not self.weak_ok) and self.strong_ok is not False


def features_of(view: RequestView) -> list[float]:
    """What a label keeps of a request instead of its text."""
    return [round(x, 5) for x in dense_features(view)]


def is_holdout(request_id: str, fraction: float = HOLDOUT_FRACTION) -> bool:
    """Deterministic split by request id: held-out labels are never trained on and are the
    ones a candidate classifier is checked on before promotion."""
    h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


# -- judges -------------------------------------------------------------------------------

_SPACE = re.compile(r"\s+")
_CHOICE_PATTERNS = (
    re.compile(r"answer\s*(?:is|:)?\s*[:\-]?\s*\(?\b([A-J])\b\)?", re.IGNORECASE),
    re.compile(r"^\s*\(?([A-J])\)?\s*(?:[.):]|$)"),  # a bare letter first: "B", "(B)", "B."
    re.compile(r"\(([A-J])\)\s*\.?\s*$"),  # "... (C)" at the end
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise(text: str) -> str:
    """Lower case, whitespace collapsed, surrounding punctuation and quotes removed."""
    return _SPACE.sub(" ", text).strip().strip(".!?,;:'\"`").strip().lower()


def exact_match(small: str, large: str) -> bool:
    return normalise(small) == normalise(large)


def final_answer(text: str) -> str | None:
    """The answer a response settles on: a multiple-choice letter, else its last number;
    None when it has neither."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].upper()
    numbers = _NUMBER.findall(text)
    if numbers:
        value = numbers[-1].replace(",", "")
        try:
            number = float(value)
        except ValueError:
            return value
        return str(int(number)) if number.is_integer() else repr(number)
    return None


def answers_agree(small: str, large: str) -> bool:
    """The small answer's final answer equals the large one's; without an extractable
    answer in the large response, normalised exact match decides."""
    want = final_answer(large)
    if want is None:
        return exact_match(small, large)
    return final_answer(small) == want


def confident(
    token_logprobs: Sequence[float], min_mean_logprob: float, min_token_logprob: float
) -> bool | None:
    """The small answer's own confidence: mean and minimum token logprob above both bounds.
    None without logprobs (no evidence either way)."""
    if not token_logprobs:
        return None
    mean = math.fsum(token_logprobs) / len(token_logprobs)
    return mean >= min_mean_logprob and min(token_logprobs) >= min_token_logprob


def builtin_verdict(
    judge: str,
    small_text: str,
    large_text: str,
    small_logprobs: Sequence[float] = (),
    min_mean_logprob: float = -1.0,
    min_token_logprob: float = -6.0,
) -> bool | None:
    """Was the small answer good enough? `judge` one of exact, final_answer, confidence."""
    if judge == "exact":
        return exact_match(small_text, large_text)
    if judge == "final_answer":
        return answers_agree(small_text, large_text)
    if judge == "confidence":
        return confident(small_logprobs, min_mean_logprob, min_token_logprob)
    raise ValueError(f"unknown built-in judge {judge!r}")


# -- export -------------------------------------------------------------------------------

_PRECEDENCE = {"shadow": 0, "escalation": 1, "feedback": 2}  # later sources say more


def merge_labels(labels: Iterable[Label]) -> list[Label]:
    """One label per request: the most direct source wins (feedback over escalation over
    shadow), the newest within a source; order of first appearance."""
    best: dict[str, Label] = {}
    for label in labels:
        held = best.get(label.request_id)
        if held is None or (_PRECEDENCE.get(label.source, 0), label.time) >= (
            _PRECEDENCE.get(held.source, 0),
            held.time,
        ):
            best[label.request_id] = label
    return list(best.values())


def training_rows(
    labels: Iterable[Label], prompts: dict[str, dict], split: str = "train"
) -> tuple[list[dict], dict[str, int]]:
    """JSONL rows `{prompt | messages, weak_ok, strong_ok, group}` for `cascade train
    --adapt`, and counts of what was left out. `prompts` maps a request id to what was kept
    of it: `{"prompt": str}` or `{"messages": [...]}` (and `max_tokens`).
    `split`: "train" (not held out), "holdout" or "all".
    An unknown `strong_ok` is taken as True (the large model is the reference); a label
    whose small outcome is unknown, or whose prompt was not kept, is left out."""
    rows: list[dict] = []
    skipped = {"no_prompt": 0, "unknown_outcome": 0, "other_split": 0}
    for label in merge_labels(labels):
        if split != "all" and is_holdout(label.request_id) != (split == "holdout"):
            skipped["other_split"] += 1
            continue
        if label.weak_ok is None:
            skipped["unknown_outcome"] += 1
            continue
        prompt = prompts.get(label.request_id)
        if prompt is None:
            skipped["no_prompt"] += 1
            continue
        rows.append(
            {
                **prompt,
                "weak_ok": label.weak_ok,
                "strong_ok": label.strong_ok is not False,
                "group": label.tenant,
                "request_id": label.request_id,
                "source": label.source,
            }
        )
    return rows, skipped
