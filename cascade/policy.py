"""Routing policy as pure functions over plain data: thresholds, overflow, escalation.

No Redis and no HTTP here: the gateway loads `RoutingSettings` (validated by
`settings_from_dict`), keeps the reference scores of the loaded classifier, and calls
these per request.
"""

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

_ABOVE_ANY_SCORE = math.nextafter(1.0, 2.0)  # a threshold no score in [0, 1] reaches
DEFAULT_TARGET_FRACTION = 0.3  # share of reference traffic `auto` sends large by default


class InvalidRouting(Exception):
    """Bad routing settings; `param` is the dotted path of the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


Logprob = Annotated[float, Meta(le=0.0)]  # natural log: at most 0
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]


class EscalationSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Re-ask the large model when the small model's answer looks unsure.

    Escalate when the mean token logprob is below `min_mean_logprob` or any token's is
    below `min_token_logprob` (natural log, so both are <= 0).
    """

    enabled: bool = False
    min_mean_logprob: Logprob = -1.5
    min_token_logprob: Logprob = -6.0


JUDGE_NAMES = ("exact", "final_answer", "confidence", "http")
JudgeName = Literal["exact", "final_answer", "confidence", "http"]
HttpUrl = Annotated[str, Meta(pattern=r"^https?://", max_length=2048)]


class LearningSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a tenant's traffic labels its router (per tenant, "*" the default).

    `shadow_fraction` of its non-streaming `auto` requests are also run on the other pool,
    off the response path and not charged to it; `judge` decides whether the small answer
    was good enough ("exact", "final_answer", "confidence" or "http" with `judge_url`).
    `feedback`: remember its `auto` requests for `feedback_ttl_s` so `POST /v1/feedback`
    can label them. `keep_prompts`: keep the prompt text of labelled requests for
    `prompt_retention_s` (without it labels hold features only and cannot train a text
    classifier). `max_labels` bounds its label stream.
    """

    shadow_fraction: Fraction = 0.0
    judge: JudgeName = "final_answer"
    judge_url: HttpUrl | None = None
    judge_min_mean_logprob: Logprob = -1.0  # the confidence judge's bounds
    judge_min_token_logprob: Logprob = -6.0
    feedback: bool = False
    feedback_ttl_s: Annotated[float, Meta(ge=1.0, le=365 * 86_400.0)] = 86_400.0
    keep_prompts: bool = False
    prompt_retention_s: Annotated[float, Meta(ge=1.0, le=3650 * 86_400.0)] = 30 * 86_400.0
    max_labels: Annotated[int, Meta(ge=1, le=10_000_000)] = 100_000


TenantId = Annotated[str, Meta(min_length=1)]


class RoutingSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Cascade thresholds: a request goes large when its score >= its threshold.

    A target fraction (0..1 of reference traffic sent large) overrides the threshold at
    the same level; a tenant's own setting overrides the defaults. Out of the box 30 % of
    reference traffic goes large (calibrated scores rarely reach 0.5); setting
    `default_threshold` without `default_target_fraction` uses the threshold instead.
    `escalation` and `learning` are per tenant, with key "*" as the default.
    `shadow_tokens_per_minute` is the operator's budget for shadow runs, over all tenants
    and gateway replicas (0: none). `version` increases with every change.

    The constraints are checked when a document is decoded (`settings_from_dict`), not on
    assignment.
    """

    default_threshold: Fraction = 0.5
    tenant_thresholds: dict[TenantId, Fraction] = msgspec.field(default_factory=dict)
    key_thresholds: dict[TenantId, Fraction] = msgspec.field(default_factory=dict)  # by key id
    default_target_fraction: Fraction | None = DEFAULT_TARGET_FRACTION
    tenant_target_fractions: dict[TenantId, Fraction] = msgspec.field(default_factory=dict)
    overflow_max_wait_s: Annotated[float, Meta(ge=0.0)] = 5.0
    escalation: dict[TenantId, EscalationSettings] = msgspec.field(default_factory=dict)
    learning: dict[TenantId, LearningSettings] = msgspec.field(default_factory=dict)
    shadow_tokens_per_minute: Annotated[int, Meta(ge=0, le=10**12)] = 0
    version: Annotated[int, Meta(ge=0)] = 0


# The per-tenant (or per-key) maps, which a PATCH merges entry by entry (merge_settings).
_MAP_FIELDS = (
    "tenant_thresholds",
    "key_thresholds",
    "tenant_target_fractions",
    "escalation",
    "learning",
)
# Keyed by tenant id (key_thresholds is keyed by key id).
_TENANT_FIELDS = ("tenant_thresholds", "tenant_target_fractions", "escalation", "learning")
# With "*", the default for tenants without their own entry.
_STAR_FIELDS = ("escalation", "learning")
# msgspec's messages end in "- at `$.a.b`"; a map's entry is "$.a[...]", naming no key.
_AT = re.compile(r" - at (?:`key` in )?`\$([^`]*)`$")
_FIELD = re.compile(r"^Object (?:contains unknown|missing required) field `(.+)`", re.DOTALL)


def settings_from_dict(raw: Any, known_tenants: set[str] | None = None) -> RoutingSettings:
    """Validate and build settings; missing fields take defaults.

    Types are strict (`true` is not a number, `"0.5"` is not a threshold) and unknown
    fields are refused. Thresholds and fractions must lie in [0, 1]; tenant keys must be in
    `known_tenants` (None: not checked). Raises `InvalidRouting` naming the field, e.g.
    `tenant_thresholds.acme`.
    """
    if not isinstance(raw, dict):
        raise InvalidRouting("routing settings must be an object", "routing")
    if "default_threshold" in raw and "default_target_fraction" not in raw:
        raw = {**raw, "default_target_fraction": None}  # an explicit threshold is meant to apply
    try:
        s = msgspec.convert(raw, RoutingSettings, strict=True)
    except msgspec.ValidationError as exc:
        message, param = _located(raw, str(exc))
        raise InvalidRouting(f"{param}: {message}", param) from None
    for name in _TENANT_FIELDS:
        for tenant in getattr(s, name):
            if (
                known_tenants is not None
                and tenant not in known_tenants
                and not (tenant == "*" and name in _STAR_FIELDS)
            ):
                raise InvalidRouting(f"unknown tenant {tenant!r} in {name}", f"{name}.{tenant}")
    for tenant, learning in s.learning.items():
        if learning.judge == "http" and learning.judge_url is None:
            param = f"learning.{tenant}.judge_url"
            raise InvalidRouting(f"learning.{tenant}: the http judge needs judge_url", param)
    return s


def _located(raw: dict, message: str) -> tuple[str, str]:
    """msgspec's message, and the dotted path of the field it is about. msgspec names no
    key inside a map (`$.learning[...].judge`): the entry is found by decoding the map's
    entries one at a time."""
    at = _AT.search(message)
    path = at.group(1) if at else ""
    text = message[: at.start()] if at else message
    if "[...]" in path:
        name = path.split("[", 1)[0].lstrip(".")
        entries: dict[str, Any] = raw[name]  # "[...]": a map's entry, so raw[name] is one
        bad = next((k for k in entries if not _decodes({name: {k: entries[k]}})), None)
        path = path.replace("[...]", f".{bad}", 1) if bad is not None else f".{name}"
    field = _FIELD.match(text)
    if field:
        path = f"{path}.{field.group(1)}"
    return text, path.lstrip(".") or "routing"


def _decodes(raw: dict) -> bool:
    try:
        msgspec.convert(raw, RoutingSettings, strict=True)
    except msgspec.ValidationError:
        return False
    return True


def settings_to_dict(s: RoutingSettings) -> dict:
    """Plain JSON-able dict; `settings_from_dict(settings_to_dict(s)) == s`."""
    return msgspec.to_builtins(s)


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


BUDGET_EASE_FROM = 0.8  # share of a tenant's spend target where `auto` starts to save


def budget_threshold(
    threshold: float, spend_fraction: float | None, ease_from: float = BUDGET_EASE_FROM
) -> float:
    """The threshold for a tenant nearing its spend target (`spend_fraction`: its spend in
    the budget's period over the target; None: no target). Below `ease_from` of the target
    it is unchanged; from there it rises linearly to 1.0 at the target, so only the
    requests scored hardest still go large, fewer as spend grows; at or past the target,
    none do. Requests are sent small before any is refused: only a hard budget refuses."""
    if spend_fraction is None or spend_fraction < ease_from:
        return threshold
    if spend_fraction >= 1.0:
        return _ABOVE_ANY_SCORE
    raised = threshold + (1.0 - threshold) * (spend_fraction - ease_from) / (1.0 - ease_from)
    return max(threshold, raised)


def route(score: float, threshold: float) -> str:
    """The pool: "large" when `score >= threshold`, else "small"."""
    return "large" if score >= threshold else "small"


def should_overflow(
    large_estimated_wait_s: float, large_pressed: bool, bound_s: float, tenant_allows: bool
) -> bool:
    """Send a large-routed request to the small pool instead (the tenant must allow it)
    when the large pool is pressed (its queue is full, or it would refuse the request for
    its TTFT target) or its estimated wait exceeds `bound_s`."""
    return tenant_allows and (large_pressed or large_estimated_wait_s > bound_s)


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
