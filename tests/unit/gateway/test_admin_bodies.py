"""The admin API's pure parts: the admin-key check, the strict decode of bodies into Structs
with the offending field as `param`, and the PATCH/PUT semantics over those Structs."""

from dataclasses import fields

import pytest

from gateway.api.admin_base import is_admin
from gateway.api.admin_schemas import (
    LimitsBody,
    NewKey,
    NewTenant,
    TenantBody,
    tenant_changes,
    whole_tenant,
)
from gateway.api.bodies import decode_struct, param_of
from quota.models import Tenant, TenantLimits
from workers.api.types import ApiError

POOLS = ("small", "large")


@pytest.mark.parametrize(
    ("header", "key", "admitted"),
    [
        ("Bearer k3y", "k3y", True),
        ("bearer   k3y", "k3y", True),
        ("BEARER k3y", "k3y", True),
        ("Bearer k3y2", "k3y", False),
        ("Bearer k3", "k3y", False),
        ("Basic k3y", "k3y", False),
        ("k3y", "k3y", False),
        ("", "k3y", False),
        ("Bearer ", "", False),
        ("Bearer ", None, False),
        ("Bearer None", None, False),
    ],
)
def test_only_the_configured_admin_key_after_bearer_is_admitted(header, key, admitted):
    assert is_admin(header, key) is admitted


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            "Expected `int | null`, got `str` - at `$.limits.tokens_per_minute`",
            "limits.tokens_per_minute",
        ),
        ("Expected `int` >= 1 - at `$.limits.max_context`", "limits.max_context"),
        ("Object contains unknown field `colour`", "colour"),
        ("Object contains unknown field `col-our`", "col-our"),
        (
            "Object contains unknown field `tokens_per_hour` - at `$.limits`",
            "limits.tokens_per_hour",
        ),
        ("Object missing required field `tenant_id`", "tenant_id"),
        ("Expected `str` of length >= 1 - at `$.allowed_models[1]`", "allowed_models[1]"),
        ("Expected `str`, got `int` - at `$.files[...]`", "files"),
        ("Expected `object`, got `array`", None),
    ],
)
def test_param_of_names_the_field_a_validation_message_is_about(message, param):
    assert param_of(message) == param


def _refusal(raw: bytes, kind) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as caught:
        decode_struct(raw, kind)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"allow_overflow": "false"}', "allow_overflow"),
        (b'{"limits": {"tokens_per_minute": "100"}}', "limits.tokens_per_minute"),
        (b'{"limits": {"tokens_per_minute": true}}', "limits.tokens_per_minute"),
        (b'{"limits": {"tokens_per_minute": 1.0}}', "limits.tokens_per_minute"),
        (b'{"limits": {"tokens_per_minute": 0}}', "limits.tokens_per_minute"),
        (b'{"limits": {"tokens_per_day": 9007199254740993}}', "limits.tokens_per_day"),
        (b'{"limits": {"tokens_per_hour": 5}}', "limits.tokens_per_hour"),
        (b'{"limits": [1]}', "limits"),
        (b'{"allowed_models": "small"}', "allowed_models"),
        (b'{"allowed_models": [""]}', "allowed_models[0]"),
        (b'{"name": ""}', "name"),
        (b'{"name": 5}', "name"),
        (b'{"colour": "red"}', "colour"),
    ],
)
def test_a_bad_tenant_body_is_a_400_naming_the_field(raw, param):
    assert _refusal(raw, TenantBody).param == param


def test_an_unknown_field_message_lists_the_fields_of_that_object():
    err = _refusal(b'{"limits": {"tokens_per_hour": 5}}', TenantBody)
    assert "tokens_per_minute" in err.message and "max_context" in err.message
    err = _refusal(b'{"tenant_id": "a", "colour": 1}', NewTenant)
    assert "allow_overflow" in err.message and "tenant_id" in err.message


def test_new_tenant_and_key_bodies_check_the_id_and_the_key_fields():
    assert _refusal(b'{"name": "x"}', NewTenant).param == "tenant_id"
    assert _refusal(b'{"tenant_id": "a b"}', NewTenant).param == "tenant_id"
    assert _refusal(b'{"expires_at": "soon"}', NewKey).param == "expires_at"
    assert _refusal(b'{"expires_at": true}', NewKey).param == "expires_at"
    assert decode_struct(b'{"expires_at": 17}', NewKey).expires_at == 17.0
    assert _refusal(b"[]", NewKey).param is None
    assert "not valid JSON" in _refusal(b"{", NewKey).message


def test_the_limits_body_has_exactly_the_tenant_limits_fields():
    assert set(LimitsBody.__struct_fields__) == {f.name for f in fields(TenantLimits)}


def _tenant(**limits) -> Tenant:  # noqa: ANN003
    return Tenant("acme", "Acme", TenantLimits(**limits), ["large"], allow_overflow=False)


def test_patch_leaves_out_what_is_left_out_and_null_clears():
    current = _tenant(tokens_per_minute=10, max_concurrent=4)
    assert tenant_changes(current, decode_struct(b"{}", TenantBody), POOLS) == {}
    body = decode_struct(b'{"limits": {"max_concurrent": null, "tokens_per_day": 7}}', TenantBody)
    changes = tenant_changes(current, body, POOLS)
    assert changes == {
        "limits": TenantLimits(tokens_per_minute=10, tokens_per_day=7, max_concurrent=None)
    }
    raw = (
        b'{"name": null, "limits": null, "allowed_models": null, "allow_overflow": null,'
        b' "priority_ceiling": null}'
    )
    cleared = tenant_changes(current, decode_struct(raw, TenantBody), POOLS)
    assert cleared == {
        "name": "acme",
        "limits": TenantLimits(),
        "allowed_models": [],
        "allow_overflow": True,
        "priority_ceiling": 0,
    }
    body = decode_struct(b'{"priority_ceiling": -1}', TenantBody)
    assert tenant_changes(current, body, POOLS) == {"priority_ceiling": -1}


def test_put_gives_every_field_left_out_its_default():
    whole = whole_tenant(
        "acme", decode_struct(b'{"limits": {"tokens_per_day": 3}}', TenantBody), POOLS
    )
    assert whole == {
        "name": "acme",
        "limits": TenantLimits(tokens_per_day=3),
        "allowed_models": [],
        "allow_overflow": True,
        "priority_ceiling": 0,
        "budget": None,
    }
    body = decode_struct(
        b'{"allowed_models": ["large", "small", "large"], "allow_overflow": false}', TenantBody
    )
    whole = whole_tenant("acme", body, POOLS)
    assert whole["allowed_models"] == ["large", "small"] and whole["allow_overflow"] is False


def test_allowed_models_must_name_existing_pools():
    body = decode_struct(b'{"allowed_models": ["small", "gpt-9"]}', TenantBody)
    with pytest.raises(ApiError) as caught:
        whole_tenant("acme", body, POOLS)
    assert caught.value.param == "allowed_models" and "gpt-9" in caught.value.message


def test_a_budget_is_set_whole_cleared_by_null_and_checked_naming_its_field():
    from quota.budget import Budget

    body = decode_struct(b'{"budget": {"period": "day", "hard": 2.5}}', TenantBody)
    whole = whole_tenant("acme", body, POOLS)
    assert whole["budget"] == Budget("day", None, 2_500_000_000)
    current = whole_tenant("acme", decode_struct(b"{}", TenantBody), POOLS)
    assert tenant_changes(current, decode_struct(b'{"budget": null}', TenantBody), POOLS) == {
        "budget": None
    }
    bad = decode_struct(b'{"budget": {"period": "rolling", "hard": 1}}', TenantBody)
    with pytest.raises(ApiError) as err:
        whole_tenant("acme", bad, POOLS)
    assert err.value.status == 400 and err.value.param == "budget.window_days"
