"""A foreign pool's settings and the gateway's measurements of it: config splitting and
checks, the upstream key (never echoed), the fields each kind takes, and the capacity the
gateway measures from what it relays."""

import pytest

from cli.config_files import fill
from gateway.capacity.measured import MeasuredService
from gateway.config import GatewayConfig, UpstreamConfig, split_pool_entries
from gateway.serving.plan import GatewayCompletionRequest, check_upstream_fields
from gateway.upstream_keys import check_upstreams, upstream_headers
from workers.api.types import ApiError
from workers.api.upstreams.fields import unsupported


def test_a_pool_entry_may_carry_its_kind_beside_its_urls():
    raw = {
        "pools": {
            "small": ["http://a:1"],
            "large": {"kind": "llamacpp", "urls": ["http://b:2"], "max_concurrency": 2},
        }
    }
    cfg = fill(GatewayConfig, split_pool_entries(raw), "test")
    assert cfg.pools == {"small": ["http://a:1"], "large": ["http://b:2"]}
    assert cfg.upstreams == {"large": UpstreamConfig(kind="llamacpp", max_concurrency=2)}
    with pytest.raises(SystemExit, match="unknown keys"):
        fill(GatewayConfig, split_pool_entries({"pools": {"x": {"knd": "vllm"}}}), "test")


@pytest.mark.parametrize(
    ("upstreams", "message"),
    [
        ({"ghost": UpstreamConfig(kind="vllm")}, "no pool 'ghost'"),
        ({"p": UpstreamConfig(kind="vlm")}, "is not one of"),
        ({"p": UpstreamConfig(kind="vllm", max_concurrency=0)}, "max_concurrency must be >= 1"),
        ({"p": UpstreamConfig(api_key_env="A", api_key_file="/f")}, "not both"),
    ],
)
def test_upstream_settings_that_cannot_work_are_refused(upstreams, message):
    with pytest.raises(ValueError, match=message):
        check_upstreams(GatewayConfig(pools={"p": ["http://x:1"]}, upstreams=upstreams))


def test_the_upstream_key_comes_from_the_environment_or_a_file_and_is_never_echoed(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("SY_UNIT_KEY", "sk-abc123")
    assert upstream_headers("p", UpstreamConfig(api_key_env="SY_UNIT_KEY")) == {
        "authorization": "Bearer sk-abc123"
    }
    (tmp_path / "key").write_text("sk-from-file\n")
    got = upstream_headers("p", UpstreamConfig(api_key_file=str(tmp_path / "key")))
    assert got == {"authorization": "Bearer sk-from-file"}
    assert upstream_headers("p", UpstreamConfig()) == {}
    monkeypatch.delenv("SY_UNIT_KEY")
    with pytest.raises(ValueError, match="SY_UNIT_KEY is not set"):
        upstream_headers("p", UpstreamConfig(api_key_env="SY_UNIT_KEY"))
    monkeypatch.setenv("SY_UNIT_KEY", "sk-bad\r\nx-injected: 1")
    with pytest.raises(ValueError) as err:
        upstream_headers("p", UpstreamConfig(api_key_env="SY_UNIT_KEY"))
    assert "sk-bad" not in str(err.value) and "control characters" in str(err.value)


def test_a_client_extra_the_pools_kind_cannot_honour_is_refused_naming_it():
    req = GatewayCompletionRequest(model="m", prompt="hi", top_k=5)
    check_upstream_fields(req, "m", "vllm")  # vLLM takes top_k
    check_upstream_fields(req, "m", "llamacpp")
    with pytest.raises(ApiError) as err:
        check_upstream_fields(req, "m", "openai")
    assert (err.value.status, err.value.param, err.value.code) == (
        400,
        "top_k",
        "unsupported_parameter",
    )
    # Values that mean "not set" are no request for the feature.
    assert unsupported("openai", {"top_k": -1, "min_p": 0.0, "stop_token_ids": []}) == []
    assert unsupported("llamacpp", {"min_tokens": 3}) == ["min_tokens"]


def test_measured_capacity_fits_the_prefill_line_and_the_step_from_streams():
    m = MeasuredService()
    assert (m.decode_step_s, m.prefill_tokens_per_s) == (None, None)
    # Streams at 20 ms a token, prefill at 1,000 tokens/s plus 30 ms of fixed cost.
    for prompt in (100, 400, 800, 1600, 200, 1200):
        m.stream(prompt, 0.030 + prompt / 1000 + 0.020, tokens=11, decode_s=10 * 0.020)
    assert m.decode_step_s == pytest.approx(0.020)
    assert m.prefill_tokens_per_s == pytest.approx(1000, rel=0.01)  # the slope, not the ratio
    # Prompts all alike: no slope to fit; the ratio counts the fixed cost as prefill (slow).
    same = MeasuredService()
    for _ in range(5):
        same.stream(500, 0.030 + 0.5 + 0.020, tokens=2, decode_s=0.020)
    assert same.prefill_tokens_per_s == pytest.approx(500 / 0.530)
    # A whole answer: a step sample until the step is known, a prefill sample after.
    whole = MeasuredService()
    whole.whole(100, total_s=1.0, tokens=10)
    assert whole.decode_step_s == pytest.approx(0.1) and whole.prefill_tokens_per_s is None
    whole.whole(100, total_s=1.1, tokens=10)
    assert whole.prefill_tokens_per_s == pytest.approx(100 / 0.1)
