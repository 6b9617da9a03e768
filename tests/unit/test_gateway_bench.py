"""`switchyard bench gateway`'s pure parts: the peer command template and the figures the
report derives (added latency, the two-process ratio, what limited a run)."""

import math
from pathlib import Path

import pytest

from benchmarks.gateway_paths import render_peer_cmd
from benchmarks.gateway_report import (
    added_latency,
    bottleneck_notes,
    paths_markdown,
    scaling_ratio,
)


def test_peer_cmd_fills_backend_port_and_dir_and_leaves_other_braces() -> None:
    cmd = render_peer_cmd(
        "B={backend}/v1 litellm --port {port} --config {dir}/c.yaml ${HOME} '{a: 1}' {port}",
        "http://127.0.0.1:8101",
        4321,
        Path("/tmp/x"),
    )
    assert cmd == (
        "B=http://127.0.0.1:8101/v1 litellm --port 4321 --config /tmp/x/c.yaml ${HOME} "
        "'{a: 1}' 4321"
    )


def _wrk(mode: str, conns: int, rps: float, **extra: float) -> dict:
    return {"mode": mode, "connections": conns, "rps": rps, "wrk_cores": 0.1, **extra}


def test_added_latency_and_scaling_are_nan_where_a_path_failed() -> None:
    lat = {"plain": {"p50": 1.0, "p99": 3.0}, "stream": {"p50": 2.0, "p99": 5.0}}
    paths = {
        "direct": {"latency_ms": lat, "wrk": [_wrk("plain", 64, 9000.0)]},
        "switchyard": {
            "latency_ms": {"plain": {"p50": 2.5, "p99": 9.0}, "stream": {"error": "boom"}},
            "wrk": [_wrk("plain", 64, 1000.0), _wrk("stream", 64, 500.0)],
        },
        "switchyard x2": {"error": "exited with 1 before ready", "what": ""},
    }
    added = added_latency(paths)
    assert added["switchyard"]["plain_p50"] == 1.5 and added["switchyard"]["plain_p99"] == 6.0
    assert math.isnan(added["switchyard"]["stream_p50"])
    assert math.isnan(added["switchyard x2"]["plain_p50"])
    assert all(math.isnan(r) for r in scaling_ratio(paths).values())
    paths["switchyard x2"] = {"wrk": [_wrk("plain", 64, 1800.0), _wrk("stream", 64, 1000.0)]}
    assert scaling_ratio(paths) == {"plain": 1.8, "stream": 2.0}


def test_notes_name_a_busy_wrk_a_cpu_bound_gateway_a_backend_bound_rate_and_few_cores() -> None:
    paths = {
        "direct": {"wrk": [_wrk("plain", 64, 1000.0), _wrk("stream", 64, 1000.0)]},
        "switchyard": {
            "wrk": [
                _wrk("plain", 64, 950.0, path_cores=0.5),
                _wrk("stream", 64, 300.0, path_cores=0.97, wrk_cores=0.95),
            ]
        },
    }
    notes = "\n".join(bottleneck_notes(paths, cpu_count=2))
    assert "switchyard stream c64: wrk used 0.95 of a core" in notes
    assert "switchyard stream c64: its processes used 0.97 cores, so it was CPU-bound" in notes
    assert "switchyard plain c64: 950 req/s is within 10% of the backend alone" in notes
    assert "This machine has 2 cores" in notes
    calm = {"switchyard": {"wrk": [_wrk("plain", 64, 300.0, path_cores=0.4)]}}
    assert bottleneck_notes(calm, cpu_count=8) == [
        "wrk stayed under 80% of a core and every gateway well below the backend alone: "
        "the gateways set these rates."
    ]


def test_without_wrk_the_report_says_so_and_still_shows_latency_and_error_rows() -> None:
    lat = {"plain": {"p50": 1.0, "p99": 3.0}, "stream": {"p50": 2.0, "p99": 5.0}}
    relay = {"p50": 1.0, "p99": 2.0, "chunks": 10}
    paths = {
        "direct": {"what": "backend", "latency_ms": lat, "relay_delay_ms": relay, "wrk": []},
        "switchyard x2": {"what": "two", "error": "RuntimeError: exited with 1 | before ready"},
    }
    data = {
        "paths": paths,
        "added_latency_ms": added_latency(paths),
        "wrk": {"available": False, "note": "wrk is not installed", "duration_s": 10.0},
    }
    md = "\n".join(paths_markdown(data))
    assert "**Skipped: wrk is not installed**" in md
    assert "| switchyard x2 | two | RuntimeError: exited with 1 / before ready |" in md
    assert "| direct | 1.00 | 3.00 | 2.00 | 5.00 |" in md


def test_money_overhead_is_the_priced_paths_cpu_per_request_over_token_quotas_alone() -> None:
    from benchmarks.gateway_report import money_overhead

    paths = {
        "switchyard": {"wrk": [_wrk("plain", 64, 1000.0, cpu_ms_per_request=0.40)]},
        "switchyard $": {
            "wrk": [
                _wrk("plain", 64, 990.0, cpu_ms_per_request=0.41),
                _wrk("stream", 64, 500.0, cpu_ms_per_request=0.9),  # no baseline: NaN
            ]
        },
    }
    money = money_overhead(paths)
    assert money["plain"]["64"] == pytest.approx(0.025)
    assert math.isnan(money["stream"]["64"])
    assert money_overhead({"switchyard": paths["switchyard"]}) == {}


def test_the_money_ab_report_gives_each_round_and_the_median_verdict() -> None:
    from benchmarks.gateway_report import money_ab_markdown

    ab = {
        "rounds": [{"tokens": 1.0, "money": 1.02}, {"tokens": 1.0, "money": 1.10}],
        "connections": 16,
        "run_s": 8.0,
        "median_added": 0.10,
        "target_added": 0.05,
    }
    text = "\n".join(money_ab_markdown(ab))
    assert "+2.0%" in text and "+10.0%" in text
    assert "Median added: +10.0% (target <= +5%): not met." in text
    assert "Not measured: wrk" in "\n".join(money_ab_markdown({"error": "wrk is not installed"}))
    assert money_ab_markdown(None) == []
