"""`switchyard bench slo`'s pure parts: goodput, level planning, the variants' configs,
the oracle's choice, the checks and the tables. No stack, no sockets, no sleeps."""

import random
from pathlib import Path

import pytest
import yaml

from benchmarks.loadgen import LoadOptions, Outcome, pick_kind
from benchmarks.slo.capacity import capacity_from
from benchmarks.slo.levels import (
    LevelResult,
    compact_fleet,
    count_over_max,
    count_stall_episodes,
    met_targets,
    request_gap_s,
    summarise_level,
)
from benchmarks.slo.plan import (
    Level,
    Targets,
    level_seed,
    plan_levels,
    stack_doc,
    strictest,
    targets_from_config,
)
from benchmarks.slo.report import error_statuses
from benchmarks.slo.tables import level_table, replicas
from benchmarks.slo.verdict import fleet_checks, mix_checks, select_oracle

REPO = Path(__file__).resolve().parents[2]
T = Targets(ttft_s=2.0, itl_s=0.2)


def ok(ttft: float, gaps: list[float], pool: str | None = "small", **kw) -> Outcome:
    return Outcome("short", 0, 0.0, 200, ttft, gaps, 1.0, len(gaps) + 1, pool=pool, **kw)


def result(variant: str, factor: float, goodput: float, **kw) -> LevelResult:
    base = dict(
        variant=variant,
        mix="tour",
        factor=factor,
        rate_per_s=factor * 2,
        duration_s=20.0,
        elapsed_s=25.0,
        offered=10,
        accepted=10,
        refused_retry_after=0,
        refused_other=0,
        no_response=0,
        failed_after_accept=0,
        ttft_p50_s=0.5,
        ttft_p99_s=1.0,
        itl_p50_s=0.05,
        itl_p99_s=0.1,
        num_good=int(goodput * 20),
        goodput_per_s=goodput,
        by_pool={"small": {"accepted": 10, "good": 10, "ttft_p99_s": 1.0, "itl_p99_s": 0.1}},
    )
    return LevelResult(**(base | kw))


# -- goodput -------------------------------------------------------------------------------


def test_a_request_counts_toward_goodput_only_within_both_targets_and_unbroken() -> None:
    assert met_targets(ok(1.9, [0.1, 0.19]), T)
    assert not met_targets(ok(2.1, [0.1]), T)  # first token late
    assert not met_targets(ok(0.5, [0.1, 0.3]), T)  # p99 of 2 gaps is the largest
    assert not met_targets(ok(0.5, [0.1], error="upstream_failed"), T)  # cut after 200
    assert met_targets(ok(0.5, []), T)  # one token: no gap to hold
    assert not met_targets(Outcome("short", 0, 0.0, 503, retry_after_s=1.0), T)


def test_the_itl_rule_p99_forgives_one_slow_gap_in_a_long_stream_and_max_does_not() -> None:
    gaps = [0.05] * 200 + [0.5]
    assert request_gap_s(gaps, "p99") == 0.05
    assert request_gap_s(gaps, "max") == 0.5
    assert met_targets(ok(0.5, gaps), T, "p99")
    assert not met_targets(ok(0.5, gaps), T, "max")
    with pytest.raises(ValueError, match="itl rule"):
        request_gap_s(gaps, "mean")


def test_a_level_separates_refusals_failures_and_goodput_per_pool_target() -> None:
    outcomes = [
        ok(0.4, [0.1, 0.1]),  # good
        ok(1.5, [0.1], pool="large"),  # large's TTFT target is 1.0: not good
        ok(0.4, [0.1], error="StreamTimeout"),  # failed after acceptance
        Outcome("long", 1, 1.0, 503, retry_after_s=2.0, done_s=0.01),
        Outcome("long", 1, 1.0, 429, done_s=0.01),  # no Retry-After
        Outcome("long", 1, 1.0, 0, error="ConnectError", done_s=0.01),
    ]
    targets = {"small": T, "large": Targets(1.0, 0.2)}
    r = summarise_level(
        "switchyard",
        "tour",
        Level(1.0, 0.3),
        outcomes,
        duration_s=10.0,
        elapsed_s=12.0,
        targets=targets,
        default=strictest(targets),
    )
    assert (r.offered, r.accepted, r.refused_retry_after, r.refused_other) == (6, 3, 1, 1)
    assert (r.no_response, r.failed_after_accept, r.num_good) == (1, 1, 1)
    assert r.goodput_per_s == 0.1
    assert r.ttft_p99_s == 1.5 and r.by_pool["large"] == {
        "accepted": 1,
        "good": 0,
        "ttft_p99_s": 1.5,
        "itl_p99_s": 0.1,
    }


def test_a_request_no_pool_answered_is_held_to_the_strictest_targets() -> None:
    targets = {"small": Targets(2.0, 0.2), "large": Targets(3.0, 0.1)}
    assert strictest(targets) == Targets(2.0, 0.1)
    r = summarise_level(
        "llama-server",
        "tour",
        Level(1.0, 1.0),
        [ok(1.0, [0.15], pool=None)],
        duration_s=1.0,
        elapsed_s=1.0,
        targets=targets,
        default=strictest(targets),
    )
    assert r.num_good == 0 and list(r.by_pool) == ["-"]


def test_capacity_counts_only_successes_ending_inside_the_window() -> None:
    done = [(1.0, ok(0.1, [])), (4.0, ok(0.1, [])), (10.0, ok(0.1, []))]
    done += [(5.0, Outcome("short", 0, 0.0, 503)), (6.0, ok(0.1, [], error="cut"))]
    c = capacity_from(done, concurrency=8, warmup_s=3.0, window_s=5.0)
    assert (c.num_ok, c.num_refused, c.num_failed) == (1, 1, 1)
    assert c.requests_per_s == 0.2


# -- levels, mixes, configs ----------------------------------------------------------------


def test_levels_are_multiples_of_the_capacity_lowest_first_without_duplicates() -> None:
    levels = plan_levels(2.5, (3.0, 0.25, 1.0, 1.0))
    assert levels == [Level(0.25, 0.625), Level(1.0, 2.5), Level(3.0, 7.5)]
    with pytest.raises(ValueError, match="capacity"):
        plan_levels(0.0, (1.0,))
    with pytest.raises(ValueError, match="factors"):
        plan_levels(1.0, (0.0,))
    seeds = {level_seed(0, m, i) for m in range(2) for i in range(5)}
    assert len(seeds) == 10


def test_weighted_mix_picks_mostly_its_heavy_kind_and_unweighted_stays_uniform() -> None:
    heavy = LoadOptions("u", ["k"], mix=("long", "short"), weights=(0.9, 0.1))
    rng = random.Random(1)
    kinds = [pick_kind(heavy, rng) for _ in range(2000)]
    assert 0.85 < kinds.count("long") / len(kinds) < 0.95
    plain = LoadOptions("u", ["k"], mix=("a", "b", "c"))
    a, b = random.Random(7), random.Random(7)
    assert [pick_kind(plain, a) for _ in range(50)] == [
        b.choice(("a", "b", "c")) for _ in range(50)
    ]


def test_targets_come_from_the_shipped_config_and_a_pool_without_them_is_refused() -> None:
    doc = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    assert targets_from_config(doc) == {"small": Targets(2.0, 0.2), "large": Targets(2.0, 0.2)}
    doc["gateway"]["options"]["ttft_target_s"] = {"large": 1.5}
    assert targets_from_config(doc)["large"] == Targets(1.5, 0.2)
    doc["pools"]["small"]["itl_target_s"] = None
    with pytest.raises(ValueError, match="small"):
        targets_from_config(doc)


def test_the_baseline_config_drops_every_target_and_the_oracle_sets_each_pools_batch() -> None:
    doc = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    doc["pools"]["small"]["engine"]["scheduler"]["itl_target_s"] = 0.3
    doc["cascade"]["classifier_path"] = "artifacts/c.json"
    before = yaml.safe_dump(doc)
    kw = dict(data_dir=Path("/tmp/d"), port=1234, model_dirs={"small": Path("/m/s")})
    base = stack_doc(doc, Path("/cfg"), with_targets=False, max_num_seqs=4, **kw)
    assert yaml.safe_dump(doc) == before  # the original is untouched
    assert base["data_dir"] == "/tmp/d" and base["gateway"]["port"] == 1234
    assert (
        base["redis_url"] is None and base["cascade"]["classifier_path"] == "/cfg/artifacts/c.json"
    )
    small, large = base["pools"]["small"], base["pools"]["large"]
    assert small["model_dir"] == "/m/s" and "model_dir" not in large
    for pool in (small, large):
        assert pool["ttft_target_s"] is None and pool["itl_target_s"] is None
        assert "itl_target_s" not in pool["engine"]["scheduler"]
        assert pool["engine"]["scheduler"]["max_num_seqs"] == 4
    assert small["engine"] is not large["engine"]  # the YAML anchor is unshared
    ours = stack_doc(doc, Path("/cfg"), **kw)
    assert ours["pools"]["large"]["ttft_target_s"] == 2.0
    assert ours["pools"]["small"]["engine"]["scheduler"]["max_num_seqs"] == 32


# -- the fleet, the oracle, the checks -----------------------------------------------------


def sample(states: list[str], max_replicas: int = 2) -> dict:
    doc = {"small": {"max_replicas": max_replicas, "replicas": []}}
    doc["small"]["replicas"] = [{"id": f"small-{i}", "state": s} for i, s in enumerate(states)]
    return {"t": 0.0, "label": "x", "pools": compact_fleet(doc)}


def test_a_replica_flapping_into_stalled_twice_is_two_episodes_and_a_third_replica_is_over() -> (
    None
):
    samples = [sample(["ready"]), sample(["stalled"]), sample(["stalled"]), sample(["ready"])]
    samples += [sample(["stalled", "starting", "starting"])]
    assert count_stall_episodes(samples) == 2
    assert count_over_max(samples) == 1
    checks = fleet_checks(2, 1, {"small": 3}, {"small": 2}, len(samples))
    assert [c.status for c in checks] == ["FAIL", "FAIL"]
    assert "small 3 (max 2)" in checks[1].detail
    assert [c.status for c in fleet_checks(0, 0, {"small": 1}, {"small": 2}, 5)] == ["PASS"] * 2


def test_the_oracle_takes_the_best_batch_per_level_and_a_tie_goes_to_the_smaller() -> None:
    by_seqs = {
        8: [result("oracle", 1.0, 1.0), result("oracle", 3.0, 2.0)],
        2: [result("oracle", 1.0, 1.0), result("oracle", 3.0, 1.5)],
        16: [result("oracle", 1.0, 0.5), result("oracle", 3.0, 2.5)],
    }
    best = select_oracle(by_seqs)
    assert [(r.factor, r.goodput_per_s, r.note) for r in best] == [
        (1.0, 1.0, "max_num_seqs=2"),
        (3.0, 2.5, "max_num_seqs=16"),
    ]


def test_checks_pass_a_sweep_that_holds_its_targets_and_name_the_figures_that_fail() -> None:
    ours = [result("switchyard", 1.0, 2.0), result("switchyard", 3.0, 1.9)]
    oracle = [result("oracle", 1.0, 2.0, note="max_num_seqs=4"), result("oracle", 3.0, 2.0)]
    llama = [result("llama-server", 1.0, 1.0), result("llama-server", 3.0, 0.5)]
    checks = mix_checks(ours, {"small": T}, T, oracle=oracle, llama=llama)
    assert [c.status for c in checks] == ["PASS"] * 6
    slow = {"small": {"accepted": 9, "good": 1, "ttft_p99_s": 1.0, "itl_p99_s": 0.35}}
    bad = [
        result("switchyard", 1.0, 2.0),
        result("switchyard", 3.0, 1.0, by_pool=slow, failed_after_accept=2),
    ]
    got = {c.name: c for c in mix_checks(bad, {"small": T}, T, oracle=oracle, llama=llama)}
    assert got["at 3x: accepted ITL p99 <= target"].status == "FAIL"
    assert "0.350 s > 0.2 s" in got["at 3x: accepted ITL p99 <= target"].detail
    assert got["0 failed after acceptance (every level)"].status == "FAIL"
    assert got["goodput at 3x >= 90% of goodput at 1x"].detail.startswith("1.000/s")
    assert got["goodput at 3x >= 90% of the oracle's"].status == "FAIL"
    assert got["goodput ahead of llama-server's at every level"].status == "PASS"


def test_checks_skip_what_was_not_run_and_a_tie_with_llama_server_is_not_ahead() -> None:
    ours = [result("switchyard", 2.0, 1.0)]
    got = mix_checks(ours, {"small": T}, T, oracle=None, llama=[result("llama-server", 2.0, 1.0)])
    by = {c.name: c for c in got}
    # Equal goodput is not ahead, unless both met every request offered (nothing to gain).
    everything = [result("switchyard", 2.0, 1.0, offered=20, num_good=20)]
    peer = [result("llama-server", 2.0, 1.0, offered=20, num_good=20)]
    tie = mix_checks(everything, {"small": T}, T, oracle=None, llama=peer)[-1]
    assert tie.status == "PASS" and "tie: both met all 20" in tie.detail
    assert by["at 2x (the issue's is 3x): accepted TTFT p99 <= target"].status == "PASS"
    assert by["goodput at 2x (the issue's is 3x) >= 90% of goodput at 1x"].status == "SKIP"
    assert by["goodput at 2x (the issue's is 3x) >= 90% of the oracle's"].status == "SKIP"
    assert by["goodput ahead of llama-server's at every level"].status == "FAIL"


# -- tables --------------------------------------------------------------------------------


def test_the_table_puts_the_variants_side_by_side_per_level() -> None:
    rows = [
        result("llama-server", 1.0, 0.5),
        result("switchyard", 3.0, 1.9, replicas_max={"small": 1}, max_replicas={"small": 2}),
        result("switchyard", 1.0, 2.0, ttft_p99_s=None),
        result("baseline", 1.0, 1.5),
    ]
    text = level_table("tour", rows, 2.0)
    lines = text.splitlines()
    assert lines[0] == "mix tour, capacity 2.00 requests/s"
    assert lines[1].split()[:3] == ["level", "variant", "offered/s"]
    body = [line.split()[:2] for line in lines[3:] if line]
    assert body == [
        ["1x", "switchyard"],
        ["1x", "baseline"],
        ["1x", "llama-server"],
        ["3x", "switchyard"],
    ]
    one = next(line for line in lines if line.startswith("1x     switchyard"))
    assert " - " in one and "2.00" in one  # no TTFT p99 shows as "-"; goodput 2.00
    assert "small 1/2" in text
    assert replicas(result("llama-server", 1.0, 0.5)) == "-"


def test_guidellm_errors_are_counted_by_http_status_and_other_errors_are_not() -> None:
    err = "HTTPStatusError(\"Server error '503 Service Unavailable' for url 'http://x/v1'\")"
    report = {
        "benchmarks": [
            {"requests": {"errored": [{"error": err, "info": {"error": "x"}}] * 2}},
            {"requests": {"errored": [{"error": "Client error '429 Too Many Requests'"}]}},
            {"requests": {"incomplete": [{"error": "Request was cancelled"}]}},
        ]
    }
    assert error_statuses(report) == {"429": 1, "503": 2}
