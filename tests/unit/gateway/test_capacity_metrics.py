"""The capacity model and its decisions as the gateway shows them: goodput judged from a
request's timings against its targets, and each pool's targets, predicted TTFT, refusals
by reason and goodput in /metrics (read at scrape time) and in GET /admin/fleet."""

import math

import pytest
from prometheus_client import CollectorRegistry

from gateway.api.admin import _capacity
from gateway.capacity.balancer import WorkerView
from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.goodput import Goodput, meets_targets
from gateway.capacity.pool import Pool
from gateway.capacity.refusals import OverCapacity, QueueFull
from gateway.metrics import GatewayMetrics

P = "switchyard_gateway_"


def view(url: str, seats: int | None = 1, running: tuple[int, ...] = (), **kw: float) -> WorkerView:
    v = WorkerView(url, "ready", len(running), 0, 10_000, 10_000, len(running), 32, answered=True)
    v.seats = seats
    v.decode_step_s = kw.get("decode_step_s", 0.05)
    v.prefill_tokens_per_s = kw.get("prefill_tokens_per_s", 1000.0)
    v.running_remaining = running
    v.itl_target_s = kw.get("itl_target_s")
    v.step_s = kw.get("step_s")
    return v


def pool_with(*views: WorkerView, name: str = "small", target: float | None = 2.0) -> Pool:
    pool = Pool(name, [], None, QueueConfig(), 32, clock=lambda: 100.0,  # type: ignore[arg-type]
                ttft_target_s=target)  # fmt: skip
    for v in views:
        pool.views[v.url] = v
    return pool


def scrape(pools: dict[str, Pool]) -> CollectorRegistry:
    registry = CollectorRegistry()
    GatewayMetrics(registry).watch_pools(lambda: pools)
    return registry


def test_a_stream_meets_its_targets_only_with_its_first_token_and_every_gap_in_time() -> None:
    def stream(first_s: float, gap_s: float, itl: float | None = 0.1) -> bool:
        return meets_targets(2.0, itl, first_token_s=first_s, max_itl_s=gap_s, whole_s=99.0,
                             num_tokens=10)  # fmt: skip

    assert stream(1.9, 0.09)
    assert not stream(2.1, 0.09)  # first token late
    assert not stream(1.9, 0.11)  # one gap past the ITL target
    assert stream(1.9, 5.0, itl=None)  # no ITL target reported: TTFT alone
    # No targets: anything is in time.
    assert meets_targets(
        math.inf, None, first_token_s=50.0, max_itl_s=1.0, whole_s=60.0, num_tokens=1
    )


def test_a_non_stream_meets_its_targets_when_the_whole_answer_came_within_their_sum() -> None:
    def whole(seconds: float, itl: float | None = 0.1) -> bool:
        return meets_targets(2.0, itl, first_token_s=None, max_itl_s=0.0, whole_s=seconds,
                             num_tokens=10)  # fmt: skip

    assert whole(2.0 + 10 * 0.1 - 0.01)
    assert not whole(2.0 + 10 * 0.1 + 0.01)
    assert whole(1.9, itl=None) and not whole(2.1, itl=None)  # no ITL target: TTFT alone


def test_goodput_counts_served_and_met_and_learns_the_typical_size() -> None:
    g = Goodput()
    assert g.typical() == (1, 1)  # nothing served yet: the smallest request
    g.record(True, 100, 50)
    g.record(False, 100, 50)
    assert (g.served, g.met) == (2, 1)
    assert g.typical() == (100, 50)


def test_the_pool_itl_target_is_its_workers_strictest_finite_one() -> None:
    pool = pool_with(view("http://a", itl_target_s=0.2), view("http://b", itl_target_s=0.1))
    assert pool.itl_target_s == 0.1
    pool.views["http://b"].itl_target_s = math.inf  # a worker's nonsense is not a target
    assert pool.itl_target_s == 0.2
    assert pool_with(view("http://a")).itl_target_s is None


def test_metrics_show_refusals_by_reason_goodput_targets_and_the_predicted_ttft() -> None:
    # One seat, held by an answer 20 tokens from done: it frees in 1 s at 0.05 s a token.
    small = pool_with(view("http://a", running=(20,), itl_target_s=0.1))
    large = pool_with(view("http://b", seats=None), name="large", target=None)
    small.count_refusal(OverCapacity("small", 3.0, 2.0, 1.0))
    small.count_refusal(OverCapacity("small", 3.0, 2.0, 1.0))
    small.count_refusal(QueueFull("small", 1.0))
    small.goodput.record(True, 100, 100)
    small.goodput.record(False, 100, 100)
    small.goodput.record(True, 100, 100)
    registry = scrape({"small": small, "large": large})

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(P + name, labels)

    assert value("refusals_total", pool="small", reason="predicted") == 2
    assert value("refusals_total", pool="small", reason="queue_full") == 1
    assert value("refusals_total", pool="small", reason="late") == 0  # every reason, from 0
    assert value("refusals_total", pool="large", reason="no_replica") == 0
    assert value("served_requests_total", pool="small") == 3
    assert value("goodput_requests_total", pool="small") == 2
    assert value("ttft_target_seconds", pool="small") == 2.0
    assert value("itl_target_seconds", pool="small") == 0.1
    assert value("completion_ratio", pool="small") == 1.0
    # The typical request served (100 prompt, 100 max) would start when the seat frees,
    # then prefill 0.1 s and take one step.
    assert value("predicted_ttft_seconds", pool="small") == pytest.approx(1.0 + 0.1 + 0.05)
    # A pool without a capacity model or a target shows neither, not a made-up number.
    assert value("predicted_ttft_seconds", pool="large") is None
    assert value("ttft_target_seconds", pool="large") is None
    assert value("itl_target_seconds", pool="large") is None


def test_the_predicted_ttft_is_read_at_scrape_time() -> None:
    pool = pool_with(view("http://a", running=(20,)))
    registry = scrape({"small": pool})
    first = registry.get_sample_value(P + "predicted_ttft_seconds", {"pool": "small"})
    pool.views["http://a"].running_remaining = (60,)  # the seat now frees in 3 s
    later = registry.get_sample_value(P + "predicted_ttft_seconds", {"pool": "small"})
    assert first == pytest.approx(1.0 + 0.001 + 0.05)  # nothing served: a 1-token request
    assert later == pytest.approx(3.0 + 0.001 + 0.05)


def test_admin_fleet_capacity_carries_the_model_and_its_decisions() -> None:
    worker = view("http://a", seats=4, running=(20,), itl_target_s=0.1, step_s=0.04)
    pool = pool_with(worker, view("http://b", seats=None))
    pool.views["http://b"].state = "draining"  # out of the rotation: not predicted on
    pool.views["http://b"].decode_step_s = math.nan  # not JSON: shown as null
    pool.count_refusal(OverCapacity("small", None, 2.0, 1.0))
    pool.goodput.record(True, 10, 10)
    doc = _capacity(pool)
    assert doc["ttft_target_s"] == 2.0 and doc["itl_target_s"] == 0.1
    assert doc["predicted_ttft_s"] == pytest.approx(0.01 + 0.05, abs=1e-4)  # a seat is free
    assert doc["refusals"] == {"late": 1}
    assert (doc["served"], doc["goodput"], doc["completion_ratio"]) == (1, 1, 1.0)
    assert doc["workers"][0] == {
        "url": "http://a",
        "seats": 4,
        "decode_step_s": 0.05,
        "prefill_tokens_per_s": 1000.0,
        "step_s": 0.04,
        "itl_target_s": 0.1,
    }
    assert doc["workers"][1]["seats"] is None and doc["workers"][1]["decode_step_s"] is None
    # No capacity model on a live replica: nothing is predicted.
    assert _capacity(pool_with(view("http://c", seats=None)))["predicted_ttft_s"] is None
