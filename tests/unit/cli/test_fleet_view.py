"""`switchyard admin fleet` shows each pool's capacity model and its decisions: targets,
predicted TTFT, refusals by reason, goodput, and each worker's seats, step and prefill."""

from cli.fleet_view import render_fleet

CAPACITY = {
    "ttft_target_s": 2.0,
    "itl_target_s": 0.2,
    "predicted_ttft_s": 0.35,
    "completion_ratio": 0.8,
    "refusals": {"predicted": 3, "late": 1},
    "served": 8,
    "goodput": 6,
    "workers": [
        {"url": "http://127.0.0.1:8101", "seats": 4, "decode_step_s": 0.012,
         "prefill_tokens_per_s": 2500.0, "step_s": 0.011, "itl_target_s": 0.2},
        {"url": "http://127.0.0.1:8102", "seats": None, "decode_step_s": None,
         "prefill_tokens_per_s": None, "step_s": None, "itl_target_s": None},
    ],
}  # fmt: skip
WORKERS = [
    {"url": "http://127.0.0.1:8101", "state": "ready", "running": 1, "waiting": 0, "inflight": 1},
]


def test_fleet_shows_the_capacity_model_and_its_decisions_per_pool() -> None:
    out = render_fleet({"small": {"waiting": 2, "workers": WORKERS, "capacity": CAPACITY}})
    lines = out.splitlines()
    assert lines[0] == "pool small: 2 waiting in the gateway"
    assert lines[1] == (
        "  capacity: TTFT target 2.00 s, ITL target 0.200 s, predicted TTFT 0.35 s, "
        "completion ratio 0.80"
    )
    assert lines[2] == "  refused: late 1, predicted 3; goodput 6/8 served within targets (75%)"
    assert lines[3].split() == [
        "http://127.0.0.1:8101", "seats", "4,", "step", "0.012", "s", "(measured", "0.011",
        "s),", "prefill", "2500", "tok/s,", "ITL", "target", "0.200", "s",
    ]  # fmt: skip
    assert lines[4].split() == ["http://127.0.0.1:8102", "no", "capacity", "model", "reported"]
    assert "running   1" in lines[5]  # the workers' table is still there, unchanged


def test_a_pool_without_targets_or_a_model_shows_dashes_not_numbers() -> None:
    bare = {**CAPACITY, "ttft_target_s": None, "itl_target_s": None, "predicted_ttft_s": None,
            "refusals": {}, "served": 0, "goodput": 0, "workers": []}  # fmt: skip
    out = render_fleet({"large": {"waiting": 0, "workers": [], "capacity": bare}})
    assert "TTFT target -, ITL target -, predicted TTFT -" in out
    assert "refused: none; goodput 0/0 served within targets" in out
    assert "%" not in out


def test_a_gateway_without_capacity_in_its_answer_renders_as_before() -> None:
    out = render_fleet({"small": {"waiting": 0, "workers": WORKERS}})
    assert "capacity" not in out and len(out.splitlines()) == 2


def test_each_member_says_where_it_came_from_and_joined_ones_show_beside_replicas() -> None:
    joined = {"url": "http://10.0.0.7:8101", "state": "ready", "running": 0, "waiting": 0,
              "inflight": 0, "origin": "joined"}  # fmt: skip
    local = {**WORKERS[0], "origin": "local"}
    out = render_fleet({"small": {"waiting": 0, "workers": [WORKERS[0], joined]}})
    assert out.splitlines()[1].endswith("(config)") and out.splitlines()[2].endswith("(joined)")
    replica = {"id": "small-0", "state": "ready", "url": WORKERS[0]["url"], "running": 1,
               "waiting": 0, "restarts": 0}  # fmt: skip
    served = render_fleet({"small": {"waiting": 0, "workers": [local, joined],
                                     "replicas": [replica]}})  # fmt: skip
    lines = served.splitlines()
    assert lines[1].split()[0] == "small-0"  # the supervisor's own replica
    assert lines[2].split()[0] == "http://10.0.0.7:8101" and lines[2].endswith("(joined)")
    assert len(lines) == 3  # the local member is the replica above, not listed twice
