"""`switchyard bench foreign`'s pure parts: the sequential and burst summaries, the
verdicts on its two targets, and the tables (no servers)."""

import math

from benchmarks.foreign_load import StreamResult
from benchmarks.foreign_report import (
    burst_rows,
    foreign_markdown,
    sequential_rows,
    summarise_burst,
    summarise_sequential,
    verdicts,
)


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
