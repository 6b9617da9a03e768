"""Validation of tenant ids, limits and model lists."""

import pytest

from quota.errors import InvalidLimits
from quota.models import TenantLimits, validate_limits, validate_models, validate_tenant_id


@pytest.mark.parametrize("tenant_id", ["a", "Acme_Corp.eu-1", "x" * 64])
def test_valid_tenant_ids_pass(tenant_id: str) -> None:
    assert validate_tenant_id(tenant_id) == tenant_id


@pytest.mark.parametrize("tenant_id", ["", "x" * 65, "a b", "a/b", "a{b}", "ü", None, 7])
def test_invalid_tenant_ids_name_the_param(tenant_id: object) -> None:
    with pytest.raises(InvalidLimits) as err:
        validate_tenant_id(tenant_id)
    assert err.value.param == "tenant_id"


def test_all_none_limits_are_valid_and_mean_unlimited() -> None:
    assert validate_limits(TenantLimits()) == TenantLimits()


@pytest.mark.parametrize("value", [0, -5, 1.5, "10", True])
@pytest.mark.parametrize("field", ["tokens_per_minute", "max_concurrent", "max_context"])
def test_non_positive_or_non_integer_limits_are_invalid(field: str, value: object) -> None:
    with pytest.raises(InvalidLimits) as err:
        validate_limits(TenantLimits(**{field: value}))
    assert err.value.param == f"limits.{field}"


def test_model_lists_must_be_pool_names() -> None:
    assert validate_models(("small", "large")) == ["small", "large"]
    for bad in ["small", [1], [""], None]:
        with pytest.raises(InvalidLimits):
            validate_models(bad)
