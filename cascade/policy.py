"""Routing policy as pure functions over plain data: thresholds, overflow, escalation.

No Redis and no HTTP here: the gateway loads `RoutingSettings` (validated by
`settings_from_dict`), keeps the reference scores of the loaded classifier, and calls
these per request.
"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

_ABOVE_ANY_SCORE = math.nextafter(1.0, 2.0)  # a threshold no score in [0, 1] reaches
DEFAULT_TARGET_FRACTION = 0.3  # share of reference traffic `auto` sends large by default


class InvalidRouting(Exception):
    """Bad routing settings; `param` is the dotted path of the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class EscalationSettings:
    """Re-ask the large model when the small model's answer looks unsure.

    Escalate when the mean token logprob is below `min_mean_logprob` or any token's is
    below `min_token_logprob` (natural log, so both are <= 0).
    """

    enabled: bool = False
    min_mean_logprob: float = -1.5
    min_token_logprob: float = -6.0


JUDGE_NAMES = ("exact", "final_answer", "confidence", "http")


@dataclass
class LearningSettings:
    """How a tenant's traffic labels its router (per tenant, "*" the default).

    `shadow_fraction` of its non-streaming `auto` requests are also run on the other pool,
    off the response path and not charged to it; `judge` decides whether the small answer
    was good enough ("exact", "final_answer", "confidence" or "http" with `judge_url`).
    `feedback`: remember its `auto` requests for `feedback_ttl_s` so `POST /v1/feedback`
    can label them. `keep_prompts`: keep the prompt text of labelled requests for
    `prompt_retention_s` (without it labels hold features only and cannot train a text
    classifier). `max_labels` bounds its label stream.
    """

    shadow_fraction: float = 0.0
    judge: str = "final_answer"
    judge_url: str | None = None
    judge_min_mean_logprob: float = -1.0  # the confidence judge's bounds
    judge_min_token_logprob: float = -6.0
    feedback: bool = False
    feedback_ttl_s: float = 86_400.0
    keep_prompts: bool = False
    prompt_retention_s: float = 30 * 86_400.0
    max_labels: int = 100_000


@dataclass
class RoutingSettings:
    """Cascade thresholds: a request goes large when its score >= its threshold.

    A target fraction (0..1 of reference traffic sent large) overrides the threshold at
    the same level; a tenant's own setting overrides the defaults. Out of the box 30 % of
    reference traffic goes large (calibrated scores rarely reach 0.5); setting
    `default_threshold` without `default_target_fraction` uses the threshold instead.
    `escalation` and `learning` are per tenant, with key "*" as the default.
    `shadow_tokens_per_minute` is the operator's budget for shadow runs, over all tenants
    and gateway replicas (0: none). `version` increases with every change.
    """

    default_threshold: float = 0.5
    tenant_thresholds: dict[str, float] = field(default_factory=dict)
    key_thresholds: dict[str, float] = field(default_factory=dict)  # by API key id
    default_target_fraction: float | None = DEFAULT_TARGET_FRACTION
    tenant_target_fractions: dict[str, float] = field(default_factory=dict)
    overflow_max_wait_s: float = 5.0
    escalation: dict[str, EscalationSettings] = field(default_factory=dict)
    learning: dict[str, LearningSettings] = field(default_factory=dict)
    shadow_tokens_per_minute: int = 0
    version: int = 0


def _number(value: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidRouting(f"{param} must be a number", param)
    if not lo <= value <= hi:
        raise InvalidRouting(f"{param} must be in [{lo}, {hi}], got {value}", param)
    return float(value)


def _tenant_map(
    raw: Any, param: str, known_tenants: set[str] | None, allow_default: bool = False
) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRouting(f"{param} must be an object keyed by tenant id", param)
    for tenant in raw:
        if allow_default and tenant == "*":
            continue
        if not isinstance(tenant, str) or (
            known_tenants is not None and tenant not in known_tenants
        ):
            raise InvalidRouting(f"unknown tenant {tenant!r} in {param}", f"{param}.{tenant}")
    return raw


def _escalation(raw: Any, param: str) -> EscalationSettings:
    if not isinstance(raw, dict):
        raise InvalidRouting(f"{param} must be an object", param)
    unknown = set(raw) - {"enabled", "min_mean_logprob", "min_token_logprob"}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRouting(f"unknown field {name!r}", f"{param}.{name}")
    out = EscalationSettings()
    if "enabled" in raw:
        if not isinstance(raw["enabled"], bool):
            raise InvalidRouting(f"{param}.enabled must be true or false", f"{param}.enabled")
        out.enabled = raw["enabled"]
    for name in ("min_mean_logprob", "min_token_logprob"):
        if name in raw:
            setattr(out, name, _number(raw[name], f"{param}.{name}", -math.inf, 0.0))
    return out


_LEARNING_NUMBERS = {
    "shadow_fraction": (0.0, 1.0),
    "judge_min_mean_logprob": (-math.inf, 0.0),
    "judge_min_token_logprob": (-math.inf, 0.0),
    "feedback_ttl_s": (1.0, 365 * 86_400.0),
    "prompt_retention_s": (1.0, 3650 * 86_400.0),
}


def _learning(raw: Any, param: str) -> LearningSettings:
    if not isinstance(raw, dict):
        raise InvalidRouting(f"{param} must be an object", param)
    unknown = set(raw) - set(LearningSettings.__dataclass_fields__)
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRouting(f"unknown field {name!r}", f"{param}.{name}")
    out = LearningSettings()
    for name, (lo, hi) in _LEARNING_NUMBERS.items():
        if name in raw:
            setattr(out, name, _number(raw[name], f"{param}.{name}", lo, hi))
    for name in ("feedback", "keep_prompts"):
        if name in raw:
            if not isinstance(raw[name], bool):
                raise InvalidRouting(f"{param}.{name} must be true or false", f"{param}.{name}")
            setattr(out, name, raw[name])
    if "max_labels" in raw:
        out.max_labels = int(_number(raw["max_labels"], f"{param}.max_labels", 1, 10_000_000))
    if "judge" in raw:
        if raw["judge"] not in JUDGE_NAMES:
            raise InvalidRouting(f"{param}.judge must be one of {JUDGE_NAMES}", f"{param}.judge")
        out.judge = raw["judge"]
    if raw.get("judge_url") is not None:
        url = raw["judge_url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidRouting(f"{param}.judge_url must be an http(s) URL", f"{param}.judge_url")
        out.judge_url = url
    if out.judge == "http" and out.judge_url is None:
        raise InvalidRouting(f"{param}: the http judge needs judge_url", f"{param}.judge_url")
    return out


def settings_from_dict(raw: dict, known_tenants: set[str] | None = None) -> RoutingSettings:
    """Validate and build settings; missing fields take defaults.

    Thresholds and fractions must lie in [0, 1]; tenant keys must be in `known_tenants`
    (None: not checked). Raises `InvalidRouting` naming the field, e.g.
    `tenant_thresholds.acme`.
    """
    if not isinstance(raw, dict):
        raise InvalidRouting("routing settings must be an object", "routing")
    fields = set(RoutingSettings.__dataclass_fields__)
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise InvalidRouting(f"unknown field {unknown[0]!r}", unknown[0])
    s = RoutingSettings()
    if "default_threshold" in raw:
        s.default_threshold = _number(raw["default_threshold"], "default_threshold", 0.0, 1.0)
        if "default_target_fraction" not in raw:  # an explicit threshold is meant to apply
            s.default_target_fraction = None
    if "default_target_fraction" in raw and raw["default_target_fraction"] is None:
        s.default_target_fraction = None
    if raw.get("default_target_fraction") is not None:
        s.default_target_fraction = _number(
            raw["default_target_fraction"], "default_target_fraction", 0.0, 1.0
        )
    for name in ("tenant_thresholds", "tenant_target_fractions"):
        if name in raw:
            table = _tenant_map(raw[name], name, known_tenants)
            setattr(s, name, {t: _number(v, f"{name}.{t}", 0.0, 1.0) for t, v in table.items()})
    if "key_thresholds" in raw:
        table = raw["key_thresholds"]
        if not isinstance(table, dict) or not all(isinstance(k, str) and k for k in table):
            raise InvalidRouting(
                "key_thresholds must be an object keyed by key id", "key_thresholds"
            )
        s.key_thresholds = {
            k: _number(v, f"key_thresholds.{k}", 0.0, 1.0) for k, v in table.items()
        }
    if "overflow_max_wait_s" in raw:
        s.overflow_max_wait_s = _number(
            raw["overflow_max_wait_s"], "overflow_max_wait_s", 0.0, math.inf
        )
    if "escalation" in raw:
        table = _tenant_map(raw["escalation"], "escalation", known_tenants, allow_default=True)
        s.escalation = {t: _escalation(v, f"escalation.{t}") for t, v in table.items()}
    if "learning" in raw:
        table = _tenant_map(raw["learning"], "learning", known_tenants, allow_default=True)
        s.learning = {t: _learning(v, f"learning.{t}") for t, v in table.items()}
    if "shadow_tokens_per_minute" in raw:
        s.shadow_tokens_per_minute = int(
            _number(raw["shadow_tokens_per_minute"], "shadow_tokens_per_minute", 0, 10**12)
        )
    if "version" in raw:
        v = raw["version"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidRouting("version must be a non-negative integer", "version")
        s.version = v
    return s


def settings_to_dict(s: RoutingSettings) -> dict:
    """Plain JSON-able dict; `settings_from_dict(settings_to_dict(s)) == s`."""
    return asdict(s)


def threshold_for_fraction(reference_scores: Sequence[float], fraction: float) -> float:
    """The score threshold that sends `fraction` of the reference traffic large.

    0 gives a threshold above any score (never large), 1 gives 0.0 (always large);
    between, the midpoint between the k-th and (k+1)-th highest reference scores,
    k = round(fraction * n). Raises ValueError on empty scores or a fraction outside [0, 1].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if not reference_scores:
        raise ValueError("no reference scores")
    if fraction >= 1.0:
        return 0.0
    if fraction <= 0.0:
        return _ABOVE_ANY_SCORE
    desc = sorted(reference_scores, reverse=True)
    k = round(fraction * len(desc))
    if k == 0:
        return math.nextafter(desc[0], math.inf)
    if k >= len(desc):
        return desc[-1]
    return (desc[k - 1] + desc[k]) / 2


def effective_threshold(
    s: RoutingSettings,
    tenant_id: str,
    reference_scores: Sequence[float],
    key_threshold: float | None = None,
    request_threshold: float | None = None,
) -> float:
    """The threshold for one request.

    Precedence: request > API key > tenant (target fraction, else threshold) >
    default (target fraction, else threshold). Fractions need `reference_scores`;
    without them the default target fraction gives way to the default threshold.
    """
    if request_threshold is not None:
        return request_threshold
    if key_threshold is not None:
        return key_threshold
    if tenant_id in s.tenant_target_fractions:
        return threshold_for_fraction(reference_scores, s.tenant_target_fractions[tenant_id])
    if tenant_id in s.tenant_thresholds:
        return s.tenant_thresholds[tenant_id]
    if s.default_target_fraction is not None and reference_scores:
        return threshold_for_fraction(reference_scores, s.default_target_fraction)
    return s.default_threshold


def route(score: float, threshold: float) -> str:
    """The pool: "large" when `score >= threshold`, else "small"."""
    return "large" if score >= threshold else "small"


def should_overflow(
    large_estimated_wait_s: float, large_queue_full: bool, bound_s: float, tenant_allows: bool
) -> bool:
    """Send a large-routed request to the small pool instead (the tenant must allow it)
    when the large pool's queue is full or its estimated wait exceeds `bound_s`."""
    return tenant_allows and (large_queue_full or large_estimated_wait_s > bound_s)


def answer_confidence(token_logprobs: Sequence[float]) -> tuple[float, float]:
    """(mean, min) token logprob of an answer; the mean is per token (length-normalised).

    An empty answer gives (0.0, 0.0): no evidence of doubt.
    """
    if not token_logprobs:
        return 0.0, 0.0
    return math.fsum(token_logprobs) / len(token_logprobs), min(token_logprobs)


def escalation_for(s: RoutingSettings, tenant_id: str) -> EscalationSettings:
    """The tenant's escalation settings, else the "*" entry, else disabled defaults."""
    return s.escalation.get(tenant_id) or s.escalation.get("*") or EscalationSettings()


def learning_for(s: RoutingSettings, tenant_id: str) -> LearningSettings | None:
    """The tenant's learning settings, else the "*" entry; None: it collects no labels."""
    return s.learning.get(tenant_id) or s.learning.get("*")


def should_escalate(token_logprobs: Sequence[float], settings: EscalationSettings) -> bool:
    """True when escalation is enabled and the answer's confidence is below either bound."""
    if not settings.enabled:
        return False
    mean, lowest = answer_confidence(token_logprobs)
    return mean < settings.min_mean_logprob or lowest < settings.min_token_logprob


_MAP_FIELDS = (
    "tenant_thresholds",
    "key_thresholds",
    "tenant_target_fractions",
    "escalation",
    "learning",
)


def merge_settings(current: dict, patch: dict) -> dict:
    """`PATCH /admin/routing`: `patch` over `current` (both plain dicts). A field left out is
    left alone; `null` resets a field to its default (`default_target_fraction`: none). The
    per-tenant and per-key maps merge by entry (`null` removes an entry); an escalation or
    learning entry merges by field. `version` is not patchable. Validate the result with
    `settings_from_dict`; raises `InvalidRouting` for a patch that is not an object."""
    if not isinstance(patch, dict):
        raise InvalidRouting("routing settings must be an object", "routing")
    defaults = settings_to_dict(RoutingSettings())
    out = {k: v for k, v in current.items() if k != "version"}
    for name, value in patch.items():
        if name == "version":
            continue
        if value is None:
            out[name] = None if name == "default_target_fraction" else defaults.get(name)
            if name not in defaults:
                out[name] = value  # unknown: left for settings_from_dict to refuse
        elif name in _MAP_FIELDS and isinstance(value, dict):
            table = dict(out.get(name) or {})
            for entry, v in value.items():
                if v is None:
                    table.pop(entry, None)
                elif isinstance(v, dict) and isinstance(table.get(entry), dict):
                    table[entry] = {**table[entry], **v}
                else:
                    table[entry] = v
            out[name] = table
        else:
            out[name] = value
    if "default_threshold" in patch and "default_target_fraction" not in patch:
        out["default_target_fraction"] = None  # an explicit threshold is meant to apply
    return out
