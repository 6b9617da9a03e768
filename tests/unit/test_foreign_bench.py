"""`switchyard bench foreign`'s pure parts: the sequential and burst summaries, the
verdicts on its two targets, the cascade's mixed load and its summaries, and the tables
(no servers)."""

import math

from benchmarks.foreign_cascade import EASY_PROMPTS, HARD_PROMPTS, MAX_TOKENS, mixed_arrivals
from benchmarks.foreign_load import StreamResult
from benchmarks.foreign_report import (
    burst_rows,
    cascade_rows,
    foreign_markdown,
    sequential_rows,
    summarise_burst,
    summarise_large_load,
    summarise_sequential,
    summarise_way,
    verdicts,
)
from benchmarks.loadgen import Outcome


def _run(direct_s: list[float], gateway_s: list[float], cpu_s: float) -> dict:
    return {
        "direct": direct_s,
        "gateway": gateway_s,
        "gateway_cpu_s": cpu_s,
        "gateway_wall_s": sum(gateway_s),
        "errors": {"direct": 1, "gateway": 0},
    }


def test_sequential_added_latency_and_cpu_net_of_idle_polling() -> None:
    run = _run([0.010, 0.010, 0.012], [0.011, 0.011, 0.015], cpu_s=0.009)
    # Idle at 0.03 cores over the gateway's 0.037 s of requests: 1.11 ms of the 9 ms.
    m = summarise_sequential(run, idle_gateway_cores=0.03)
    assert math.isclose(m["added_p50_ms"], 1.0)
    assert math.isclose(m["added_p99_ms"], 14.94 - 11.98, rel_tol=1e-9)
    assert math.isclose(m["gateway_cpu_ms_per_request"], 3.0)
    assert math.isclose(m["gateway_cpu_ms_per_request_net"], 3.0 - 0.03 * 37 / 3)
    assert m["failed"] == {"direct": 1, "gateway": 0}


def test_sequential_with_no_gateway_request_gives_nan_not_a_division_error() -> None:
    m = summarise_sequential(_run([0.01], [], cpu_s=0.0), idle_gateway_cores=0.0)
    assert math.isnan(m["gateway_cpu_ms_per_request"]) and math.isnan(m["added_p50_ms"])


def _served(ttft_s: float, chunks: int = 10) -> StreamResult:
    return StreamResult(200, False, ttft_s, chunks, ttft_s + 1.0)


def test_burst_counts_refusals_before_any_token_and_late_accepted_streams() -> None:
    results = [
        _served(0.5),
        _served(2.5),  # accepted, past a 2 s target
        StreamResult(503, True, None, 0, 0.01),
        StreamResult(429, False, None, 0, 0.01),
        StreamResult(200, False, None, 0, 0.2, error_in_band=True),
        StreamResult(None, False, None, 0, 5.0),  # the connection failed
    ]
    b = summarise_burst(results, wall_s=4.0, ttft_target_s=2.0)
    assert (b["sent"], b["served"], b["refused"], b["failed"]) == (6, 2, 3, 1)
    assert b["refused_with_retry_after"] == 1
    assert b["refused_statuses"] == [429, 503] and b["refused_in_band"] == 1
    assert b["late"] == 1
    assert math.isclose(b["ttft_p50_ms"], 1500.0)
    assert math.isclose(b["tokens_per_s"], 5.0)


def _data(added_p50_ms: float, late: int) -> dict:
    seq = {
        mode: summarise_sequential(
            _run([0.010, 0.010], [0.010 + added_p50_ms / 1e3] * 2, 0.004), 0.0
        )
        for mode in ("plain", "stream")
    }
    gateway = summarise_burst([_served(0.5)] + [_served(3.0)] * late, 2.0, 2.0)
    return {
        "options": {
            "slots": 2,
            "threads": 1,
            "ctx_per_slot": 512,
            "cpu_count": 2,
            "num_pairs": 2,
            "max_tokens": 4,
            "burst_streams": 8,
            "burst_tokens": 64,
            "ttft_target_s": 2.0,
        },
        "idle_gateway_cores": 0.03,
        "sequential": seq,
        "burst": {"direct": summarise_burst([_served(4.0)], 5.0, 2.0), "gateway": gateway},
    }


def test_verdicts_meet_and_miss_each_target() -> None:
    assert verdicts(_data(1.5, 0)) == {"added_p50_le_2ms": True, "burst_no_accepted_late": True}
    assert verdicts(_data(2.5, 1)) == {"added_p50_le_2ms": False, "burst_no_accepted_late": False}


def test_a_failed_part_is_no_verdict_and_an_error_row() -> None:
    data = _data(1.0, 0)
    data["sequential"]["stream"] = {"error": "RemoteProtocolError: boom"}
    data["burst"]["gateway"] = {"error": "RuntimeError: no gateway"}
    assert verdicts(data) == {"added_p50_le_2ms": None, "burst_no_accepted_late": None}
    assert sequential_rows(data["sequential"])[1] == {
        "mode": "stream",
        "direct_p50": "RemoteProtocolError: boom",
    }
    assert burst_rows(data["burst"])[1] == {"path": "gateway", "sent": "RuntimeError: no gateway"}


def test_markdown_has_both_tables_and_the_verdict_lines() -> None:
    data = _data(2.5, 0)
    data["verdicts"] = verdicts(data)
    md = foreign_markdown(data)
    assert "| plain | 10.00 | 10.00 | 12.50 | 12.50 | 2.50 |" in md
    assert "| gateway | 1 | 1 | 0 | 0 | 0 | 0 | 500 |" in md
    assert "- added p50 <= 2 ms: NOT met" in md
    assert "- 0 accepted burst requests past the TTFT target: met" in md


def test_shipped_classifier_routes_easy_prompts_small_and_hard_ones_large_by_default() -> None:
    from cascade.classifier import load_reference_scores, load_scorer
    from cascade.policy import RoutingSettings, effective_threshold, route

    scorer, fell_back = load_scorer()
    assert not fell_back
    threshold = effective_threshold(RoutingSettings(), "t", load_reference_scores())
    for kind, prompts in (("easy", EASY_PROMPTS), ("hard", HARD_PROMPTS)):
        for prompt in prompts:
            score = scorer.score("", [{"role": "user", "content": prompt}], MAX_TOKENS[kind])
            assert route(score, threshold) == ("small" if kind == "easy" else "large"), prompt


def test_mixed_arrivals_repeat_for_a_seed_and_draw_hard_at_its_share() -> None:
    a = mixed_arrivals(5.0, 200.0, 0.3, seed=1)
    assert a == mixed_arrivals(5.0, 200.0, 0.3, seed=1) != mixed_arrivals(5.0, 200.0, 0.3, 2)
    assert 900 < len(a) < 1100 and all(0 <= x.at_s < 200 for x in a)
    hard = [x for x in a if x.kind == "hard"]
    assert 0.25 < len(hard) / len(a) < 0.35
    assert all(x.prompt in HARD_PROMPTS for x in hard)
    assert all(x.prompt in EASY_PROMPTS for x in a if x.kind == "easy")
    assert {x.kind for x in mixed_arrivals(5.0, 20.0, 0.0, 0)} == {"easy"}


def _outcome(kind: str, pool: str | None, ttft_s: float | None = 0.1, **kw) -> Outcome:
    o = Outcome(kind, 0, 0.0, status=kw.pop("status", 200), ttft_s=ttft_s, pool=pool, **kw)
    o.done_s = 1.0
    return o


def test_way_summary_counts_refusals_and_the_share_each_kind_got_on_small() -> None:
    outcomes = [
        _outcome("easy", "small", 0.1, completion_tokens=30, route="classifier"),
        _outcome("easy", "small", 0.3, completion_tokens=30, route="classifier"),
        _outcome("hard", "large", 0.5, completion_tokens=120, route="classifier"),
        _outcome("hard", "small", 0.2, completion_tokens=120, route="overflow"),
        _outcome("hard", "large", None, status=503),
        _outcome("easy", "small", None, error="over capacity"),  # in-band, before a token
        _outcome("easy", None, None, status=0, error="ConnectError()"),
    ]
    w = summarise_way(outcomes, wall_s=10.0)
    assert (w["sent"], w["served"], w["refused"], w["failed"]) == (7, 4, 2, 1)
    assert math.isclose(w["small_share"], 0.75)
    assert (w["small_share_easy"], w["small_share_hard"]) == (1.0, 0.5)
    assert w["overflowed"] == 1
    assert math.isclose(w["tokens_per_s"], 30.0)
    assert math.isclose(w["ttft_p50_ms"], 250.0)
    assert w["first_error"] == "over capacity"


def test_large_load_is_sampled_slots_and_the_counters_difference() -> None:
    def m(busy: float, waiting: float, out: float = 0.0, prompt: float = 0.0) -> dict:
        return {
            "requests_processing": busy,
            "requests_deferred": waiting,
            "tokens_predicted_total": out,
            "prompt_tokens_total": prompt,
        }

    samples = [m(2, 1), m(1, 3), m(0, 0)]
    load = summarise_large_load(samples, m(0, 0, 100, 50), m(0, 0, 400, 250), 10.0, 2)
    assert math.isclose(load["busy_slots_mean"], 1.0) and load["waiting_max"] == 3
    assert (load["output_tokens"], load["prompt_tokens"]) == (300, 200)
    assert math.isclose(load["tokens_per_s"], 30.0)
    assert math.isnan(summarise_large_load([], m(0, 0), m(0, 0), 1.0, 2)["busy_slots_mean"])


def test_markdown_has_the_cascade_table_and_no_section_for_a_skipped_part() -> None:
    data = _data(1.0, 0)
    del data["sequential"]
    data["options"] |= {"cascade_rate_per_s": 1.0, "cascade_duration_s": 10.0}
    busy = [{"requests_processing": 1.0, "requests_deferred": 0.0}]
    zero = {"tokens_predicted_total": 0.0, "prompt_tokens_total": 0.0}
    way = summarise_way([_outcome("easy", "small"), _outcome("hard", "large")], 2.0)
    data["cascade"] = {
        "arrivals": 2,
        "hard": 1,
        "auto": way | {"model": "auto", "large": summarise_large_load(busy, zero, zero, 2.0, 2)},
        "small": {"model": "small", "error": "RuntimeError: worker exited"},
    }
    data["verdicts"] = verdicts(data)
    md = foreign_markdown(data)
    assert "## Sequential" not in md and "## Burst" in md
    assert "2 requests (1 hard) at 1.0 /s for 10.0 s per way" in md
    assert "| auto (auto) | 2 | 2 | 0 | 0 | 50 | 100/0 | 0 |" in md
    assert "| 1.00 of 2 | 0.00 | 0.00 |" in md
    assert cascade_rows(data["cascade"])[1] == {
        "way": "small (small)",
        "sent": "RuntimeError: worker exited",
    }
    assert "- added p50 <= 2 ms: n/a (not measured)" in md


def test_the_reference_table_is_our_own_kind_at_the_same_latency_and_no_verdict() -> None:
    data = _data(2.5, 0)
    ref = {"token_delay_s": 0.0125, "sequential": {"plain": data["sequential"]["plain"]}}
    data["reference"] = ref
    data["verdicts"] = verdicts(data)
    md = foreign_markdown(data)
    assert "kind (`switchyard`) in front of the fake backend" in md and "12.5 ms a token" in md
    assert md.count("| plain | 10.00 | 10.00 | 12.50 | 12.50 | 2.50 |") == 2
    data["reference"] = {"error": "RuntimeError: no backend"}
    assert "not run: RuntimeError: no backend" in foreign_markdown(data)
    assert verdicts(data)["added_p50_le_2ms"] is False  # the foreign rows alone decide
