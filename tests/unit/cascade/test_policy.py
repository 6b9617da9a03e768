"""Routing policy: validation, threshold precedence, fractions, overflow, escalation."""

import pytest

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

REF = [i / 100 for i in range(100)]  # 0.00 .. 0.99


def test_fraction_threshold_sends_that_fraction_of_reference_traffic_large() -> None:
    for fraction in (0.1, 0.25, 0.5, 0.9):
        t = threshold_for_fraction(REF, fraction)
        sent = sum(route(s, t) == "large" for s in REF) / len(REF)
        assert sent == pytest.approx(fraction)
    assert all(route(s, threshold_for_fraction(REF, 0.0)) == "small" for s in REF + [1.0])
    assert all(route(s, threshold_for_fraction(REF, 1.0)) == "large" for s in REF + [0.0])
    with pytest.raises(ValueError):
        threshold_for_fraction(REF, 1.5)
    with pytest.raises(ValueError):
        threshold_for_fraction([], 0.5)


def test_threshold_precedence_request_key_tenant_default() -> None:
    s = RoutingSettings(
        default_threshold=0.5,
        default_target_fraction=None,
        tenant_thresholds={"acme": 0.3, "both": 0.2},
        tenant_target_fractions={"frac": 0.1, "both": 0.5},
    )
    assert effective_threshold(s, "acme", REF, key_threshold=0.4, request_threshold=0.9) == 0.9
    assert effective_threshold(s, "acme", REF, key_threshold=0.4) == 0.4
    assert effective_threshold(s, "acme", REF) == 0.3
    assert effective_threshold(s, "frac", REF) == threshold_for_fraction(REF, 0.1)
    assert effective_threshold(s, "both", REF) == threshold_for_fraction(REF, 0.5)
    assert effective_threshold(s, "other", REF) == 0.5
    s.default_target_fraction = 0.25
    assert effective_threshold(s, "other", REF) == threshold_for_fraction(REF, 0.25)
    assert effective_threshold(s, "acme", REF) == 0.3  # tenant beats the default fraction


def test_out_of_the_box_a_target_fraction_of_traffic_goes_large() -> None:
    s = settings_from_dict({})
    assert s.default_target_fraction == 0.3
    assert effective_threshold(s, "t", REF) == threshold_for_fraction(REF, 0.3)
    assert effective_threshold(s, "t", []) == s.default_threshold  # no reference: threshold
    explicit = settings_from_dict({"default_threshold": 0.7})
    assert explicit.default_target_fraction is None
    assert effective_threshold(explicit, "t", REF) == 0.7


def test_learning_settings_are_validated_per_tenant() -> None:
    s = settings_from_dict(
        {"learning": {"acme": {"shadow_fraction": 0.2, "judge": "exact"}}},
        known_tenants={"acme"},
    )
    assert s.learning["acme"].shadow_fraction == 0.2 and s.learning["acme"].judge == "exact"
    assert settings_from_dict(settings_to_dict(s)) == s
    for bad, param in (
        ({"acme": {"shadow_fraction": 2}}, "learning.acme.shadow_fraction"),
        ({"acme": {"judge": "vibes"}}, "learning.acme.judge"),
        ({"acme": {"judge": "http"}}, "learning.acme.judge_url"),
        ({"ghost": {}}, "learning.ghost"),
    ):
        with pytest.raises(InvalidRouting) as err:
            settings_from_dict({"learning": bad}, known_tenants={"acme"})
        assert err.value.param == param


def test_route_is_large_at_or_above_threshold() -> None:
    assert route(0.5, 0.5) == "large"
    assert route(0.4999, 0.5) == "small"


def test_settings_round_trip_and_validation_names_the_param() -> None:
    raw = {
        "default_threshold": 0.4,
        "tenant_thresholds": {"acme": 0.7},
        "tenant_target_fractions": {"beta": 0.2},
        "escalation": {"*": {"enabled": True}, "acme": {"min_mean_logprob": -1.0}},
        "overflow_max_wait_s": 2.0,
        "version": 3,
    }
    s = settings_from_dict(raw, {"acme", "beta"})
    assert s.escalation["*"].enabled and s.escalation["acme"].min_mean_logprob == -1.0
    assert settings_from_dict(settings_to_dict(s), {"acme", "beta"}) == s
    bad = [
        ({"default_threshold": 1.5}, "default_threshold"),
        ({"default_threshold": True}, "default_threshold"),
        ({"tenant_thresholds": {"acme": -0.1}}, "tenant_thresholds.acme"),
        ({"tenant_thresholds": {"ghost": 0.5}}, "tenant_thresholds.ghost"),
        ({"tenant_target_fractions": {"acme": 2}}, "tenant_target_fractions.acme"),
        ({"default_target_fraction": -1}, "default_target_fraction"),
        ({"escalation": {"ghost": {}}}, "escalation.ghost"),
        ({"escalation": {"acme": {"min_token_logprob": 1.0}}}, "escalation.acme.min_token_logprob"),
        ({"escalation": {"acme": {"colour": 1}}}, "escalation.acme.colour"),
        ({"overflow_max_wait_s": -1}, "overflow_max_wait_s"),
        ({"version": -1}, "version"),
        ({"threshold": 0.5}, "threshold"),
    ]
    for raw_bad, param in bad:
        with pytest.raises(InvalidRouting) as info:
            settings_from_dict(raw_bad, {"acme"})
        assert info.value.param == param, raw_bad
    assert settings_from_dict({"tenant_thresholds": {"ghost": 0.5}}, None).tenant_thresholds


def test_overflow_only_when_allowed_and_large_pool_is_backed_up() -> None:
    assert should_overflow(6.0, False, 5.0, True)
    assert should_overflow(0.0, True, 5.0, True)
    assert not should_overflow(5.0, False, 5.0, True)
    assert not should_overflow(60.0, True, 5.0, False)


def test_escalation_on_low_mean_or_one_very_unsure_token() -> None:
    on = EscalationSettings(enabled=True, min_mean_logprob=-1.5, min_token_logprob=-6.0)
    assert answer_confidence([-1.0, -3.0]) == (-2.0, -3.0)
    assert answer_confidence([]) == (0.0, 0.0)
    assert should_escalate([-1.0, -3.0], on)  # mean -2.0 < -1.5
    assert should_escalate([-0.1, -0.1, -7.0, -0.1, -0.1, -0.1], on)  # one token < -6
    assert not should_escalate([-0.2, -0.5], on)
    assert not should_escalate([], on)
    assert not should_escalate([-9.0], EscalationSettings(enabled=False))


def test_escalation_settings_fall_back_to_star_then_disabled() -> None:
    s = RoutingSettings(escalation={"*": EscalationSettings(enabled=True)})
    assert escalation_for(s, "anyone").enabled
    s.escalation["acme"] = EscalationSettings(enabled=False)
    assert not escalation_for(s, "acme").enabled
    assert not escalation_for(RoutingSettings(), "acme").enabled


def test_merge_settings_keeps_what_a_patch_leaves_out_and_null_resets():
    from cascade.policy import merge_settings

    current = settings_to_dict(
        settings_from_dict(
            {
                "tenant_thresholds": {"a": 0.2, "b": 0.4},
                "overflow_max_wait_s": 9.0,
                "escalation": {"*": {"enabled": True}},
            }
        )
    )
    merged = merge_settings(
        current,
        {
            "tenant_thresholds": {"a": None, "c": 0.7},
            "escalation": {"*": {"min_mean_logprob": -2.0}},
            "overflow_max_wait_s": None,
            "version": 99,
        },
    )
    s = settings_from_dict(merged)
    assert s.tenant_thresholds == {"b": 0.4, "c": 0.7}
    assert s.escalation["*"].enabled is True and s.escalation["*"].min_mean_logprob == -2.0
    assert s.overflow_max_wait_s == 5.0  # null: the default
    assert s.version == 0  # not patchable
    assert (
        settings_from_dict(
            merge_settings(current, {"default_threshold": 0.6})
        ).default_target_fraction
        is None
    )


def test_settings_decode_strictly_and_name_the_entry_inside_a_map() -> None:
    for raw_bad, param in (
        ({"default_threshold": "0.5"}, "default_threshold"),  # a string is not a number
        ({"default_threshold": float("nan")}, "default_threshold"),
        ({"shadow_tokens_per_minute": 1.5}, "shadow_tokens_per_minute"),
        ({"tenant_thresholds": {"": 0.5}}, "tenant_thresholds"),
        ({"tenant_thresholds": [0.5]}, "tenant_thresholds"),
        ({"escalation": {"acme": {"enabled": "yes"}}}, "escalation.acme.enabled"),
        ({"learning": {"acme": {"judge_url": "ftp://judge"}}}, "learning.acme.judge_url"),
        ({"learning": {"*": {"max_labels": 0}}}, "learning.*.max_labels"),
        ({"key_thresholds": {"k1": 0.1, "k2": 7}}, "key_thresholds.k2"),
    ):
        with pytest.raises(InvalidRouting) as info:
            settings_from_dict(raw_bad, {"acme"})
        assert info.value.param == param, raw_bad
        assert info.value.message.startswith(f"{param}: "), info.value.message


def test_a_tenant_nearing_its_spend_target_sends_less_to_the_large_pool() -> None:
    from cascade.policy import budget_threshold, route

    assert budget_threshold(0.4, None) == 0.4  # no target
    assert budget_threshold(0.4, 0.5) == 0.4  # far from it
    assert budget_threshold(0.4, 0.8) == 0.4  # where easing starts
    assert budget_threshold(0.4, 0.9) == pytest.approx(0.7)  # half way: half way to 1
    assert budget_threshold(0.95, 0.85) == pytest.approx(0.9625)
    # The threshold only rises, and at the target nothing goes large, whatever the score.
    steps = [budget_threshold(0.3, f / 100) for f in range(0, 130, 5)]
    assert steps == sorted(steps)
    assert route(1.0, budget_threshold(0.3, 1.0)) == "small"
    assert route(1.0, budget_threshold(0.3, 2.5)) == "small"
    assert route(0.99, budget_threshold(0.3, 0.99)) == "large"  # the hardest still go
