"""cascade package (see docs/architecture.md)."""

from cascade.classifier import (
    DEFAULT_ARTIFACT,
    DifficultyScorer,
    LengthHeuristicScorer,
    load_reference_scores,
    load_scorer,
)
from cascade.policy import (
    EscalationSettings,
    InvalidRouting,
    RoutingSettings,
    answer_confidence,
    effective_threshold,
    escalation_for,
    route,
    settings_from_dict,
    settings_to_dict,
    should_escalate,
    should_overflow,
    threshold_for_fraction,
)

__all__ = [
    "DEFAULT_ARTIFACT",
    "DifficultyScorer",
    "EscalationSettings",
    "InvalidRouting",
    "LengthHeuristicScorer",
    "RoutingSettings",
    "answer_confidence",
    "effective_threshold",
    "escalation_for",
    "load_reference_scores",
    "load_scorer",
    "route",
    "settings_from_dict",
    "settings_to_dict",
    "should_escalate",
    "should_overflow",
    "threshold_for_fraction",
]
