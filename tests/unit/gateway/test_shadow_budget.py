"""The shadow budget's policy (pure): a max-min fair split over the tenants' demand, and
whole runs within a share."""

import math

from gateway.learning.shadow_budget import demands_of, fair_shares, may_take


def test_equal_demands_split_evenly_and_a_lone_tenant_gets_everything():
    assert fair_shares(100, {"a": math.inf, "b": math.inf}) == {"a": 50, "b": 50}
    assert fair_shares(100, {"a": math.inf}) == {"a": 100}
    assert fair_shares(100, {}) == {}


def test_a_light_tenant_gets_what_it_asks_and_leaves_the_rest_to_the_others():
    shares = fair_shares(100, {"heavy": 400, "light": 10, "mid": 40})
    assert shares == {"light": 10, "mid": 40, "heavy": 50}
    assert fair_shares(90, {"a": math.inf, "b": 20, "c": math.inf}) == {"b": 20, "a": 35, "c": 35}
    assert sum(fair_shares(7, {"a": 1, "b": 100, "c": 100}).values()) == 7
    # Demands under the budget in all: each gets what it asks, nothing more is promised.
    assert fair_shares(100, {"a": 10, "b": 20}) == {"a": 10, "b": 20}


def test_demand_is_this_minutes_asks_and_last_minutes_for_the_rest_of_it():
    demands = demands_of({"steady": 30, "new": 5}, {"steady": 60, "gone": 40}, to_come=0.5)
    # steady: 30 so far and half of last minute's 60 to come; new: all it can get;
    # gone (asked last minute, not yet in this one): a claim that fades as the minute goes
    assert demands == {"steady": 60, "new": math.inf, "gone": 20}
    assert demands_of({}, {"gone": 40}, to_come=0.25) == {"gone": 10}


def test_a_run_must_fit_the_minute_and_the_share_unless_it_is_the_tenants_first():
    assert may_take(10, mine=40, share=50, total=90, limit=100)
    assert not may_take(10, mine=50, share=50, total=60, limit=100)  # its share is spent
    assert not may_take(10, mine=0, share=50, total=95, limit=100)  # the minute is spent
    # 200 tenants on a budget of 50 tokens each and runs of 200: one run each, first come
    assert may_take(200, mine=0, share=50, total=0, limit=10_000)
    assert not may_take(200, mine=200, share=50, total=200, limit=10_000)
