"""Pure request planning: output budget, context, deadlines, upstream body, charges."""

import msgspec
import pytest

from cascade.policy import EscalationSettings
from gateway.serving.plan import (
    GatewayChatRequest,
    GatewayCompletionRequest,
    Plan,
    Served,
    affinity_of,
    charge,
    check_context,
    is_structured,
    max_tokens_of,
    timeout_of,
    upstream_body,
)
from workers.api.types import ApiError


def chat(**fields) -> GatewayChatRequest:
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=GatewayChatRequest)


def completion(**fields) -> GatewayCompletionRequest:
    body = {"model": "small", "prompt": "hello", **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=GatewayCompletionRequest)


def plan(**fields) -> Plan:
    base = dict(
        request_id="gw-1",
        tenant_id="acme",
        pool="small",
        route="forced",
        chat=False,
        stream=False,
        wants_usage=False,
        client_logprobs=False,
        prompt_tokens=10,
        max_tokens=20,
        deadline=100.0,
        affinity=None,
    )
    return Plan(**{**base, **fields})


def test_max_tokens_defaults_and_prefers_max_completion_tokens():
    assert max_tokens_of(completion(), 256, 4096) == 256
    assert max_tokens_of(completion(max_tokens=7), 256, 4096) == 7
    assert max_tokens_of(chat(max_tokens=7, max_completion_tokens=9), 256, 4096) == 9


@pytest.mark.parametrize("value", [0, -1, 4097])
def test_max_tokens_out_of_range_names_the_field(value):
    with pytest.raises(ApiError) as err:
        max_tokens_of(chat(max_completion_tokens=value), 256, 4096)
    assert err.value.status == 400 and err.value.param == "max_completion_tokens"


def test_context_is_checked_against_the_key_and_the_model():
    check_context(10, 20, 30, 30)
    with pytest.raises(ApiError) as err:
        check_context(10, 21, 30, None)
    assert err.value.code == "context_length_exceeded" and "key" in err.value.message
    with pytest.raises(ApiError) as err:
        check_context(10, 21, None, 30)
    assert "model" in err.value.message


@pytest.mark.parametrize("header", ["nan", "NaN", "inf", "-1", "0", "1e309", "abc", "", "86401"])
def test_invalid_timeout_headers_are_400(header):
    with pytest.raises(ApiError) as err:
        timeout_of(header, 120.0)
    assert err.value.status == 400 and err.value.param == "x-request-timeout"


def test_timeout_header_is_capped_by_the_default():
    assert timeout_of(None, 120.0) == 120.0
    assert timeout_of("2.5", 120.0) == 2.5
    assert timeout_of("600", 120.0) == 120.0


def test_upstream_body_overrides_the_operators_fields_and_drops_gateway_ones():
    req = completion(
        priority=-1000, cache_salt="other-tenant", ignore_eos=True, switchyard_threshold=0.5
    )
    sent = msgspec.json.decode(upstream_body(req, plan(), "salt-acme"))
    assert sent["cache_salt"] == "salt-acme"
    assert sent.get("priority", 0) == 0
    assert sent.get("ignore_eos", False) is False
    assert "switchyard_threshold" not in sent
    assert sent["max_tokens"] == 20 and sent["model"] == "small"


def test_upstream_body_passes_the_speculation_hint_to_our_workers_only():
    req = completion(num_speculative_tokens=2)
    assert msgspec.json.decode(upstream_body(req, plan(), "s"))["num_speculative_tokens"] == 2
    sent = msgspec.json.decode(upstream_body(req, plan(), "s", kind="vllm"))
    assert "num_speculative_tokens" not in sent


def test_upstream_body_of_a_stream_always_asks_for_usage():
    req = completion(stream=True)
    sent = msgspec.json.decode(upstream_body(req, plan(stream=True), "s"))
    assert sent["stream_options"] == {"include_usage": True}


def test_upstream_chat_body_carries_the_budget_in_max_tokens_only():
    req = chat(max_completion_tokens=5)
    sent = msgspec.json.decode(upstream_body(req, plan(chat=True, max_tokens=5), "s"))
    assert sent["max_tokens"] == 5 and "max_completion_tokens" not in sent


def test_escalation_body_asks_for_logprobs_and_the_other_pool():
    sent = msgspec.json.decode(upstream_body(chat(), plan(chat=True), "s", with_logprobs=True))
    assert sent["logprobs"] is True
    sent = msgspec.json.decode(
        upstream_body(completion(), plan(), "s", pool="large", with_logprobs=True)
    )
    assert sent["logprobs"] == 0 and sent["model"] == "large"


def test_escalation_reserves_both_attempts():
    assert plan().reserve_tokens == 30
    escalating = plan(escalation=EscalationSettings(enabled=True))
    assert escalating.reserve_tokens == 60


def test_n_samples_reserve_the_prompt_once_and_n_budgets():
    assert plan(n=3).attempt_tokens == 10 + 3 * 20
    assert plan(n=3, escalation=EscalationSettings(enabled=True)).reserve_tokens == 140
    assert charge(plan(n=3), Served(accepted=True, tokens_relayed=999)) == 70


def test_tools_and_json_formats_are_flagged_structured():
    assert is_structured(completion(response_format={"type": "json_object"}))
    assert not is_structured(completion(response_format={"type": "text"}))
    assert not is_structured(completion())


def test_charge_is_usage_when_known():
    served = Served(accepted=True, usage_prompt_tokens=12, usage_completion_tokens=3)
    assert charge(plan(), served) == 15


def test_charge_of_a_cut_stream_is_prompt_plus_relayed_within_budget():
    assert charge(plan(), Served(accepted=True, tokens_relayed=4)) == 14
    assert charge(plan(), Served(accepted=True, tokens_relayed=999)) == 30


def test_refused_or_undispatched_requests_are_charged_nothing():
    assert charge(plan(), Served()) == 0
    assert charge(plan(), Served(accepted=False, tokens_relayed=0)) == 0


def test_affinity_follows_the_system_prompt_or_prompt_head():
    sys_chat = chat(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    )
    other = chat(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "y"}]
    )
    assert affinity_of(sys_chat) == affinity_of(other) is not None
    assert affinity_of(chat()) is None
    assert affinity_of(completion(prompt=[1, 2, 3])) is not None
    assert affinity_of(completion()) is not None
