"""The scheduler's fair share between tenants, in tokens of work: one tenant's queue of long
prompts does not hold back another tenant's first token, backlogged tenants get about equal
budget, and within one tenant the order is what it always was."""

from tests.unit.workers.scheduler_factories import (
    make_request,
    make_scheduler,
    run_to_completion,
    scheduled_ids,
    step,
)
from workers.engine.scheduler import TenantService


def test_a_light_tenants_prompt_is_prefilled_in_the_step_after_it_arrives() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=64, num_blocks=4096)
    for i in range(16):  # a heavy tenant: 16 prompts of 512 tokens, 8 k tokens of prefill
        sched.add(make_request(f"heavy{i}", 512, tenant="heavy", max_tokens=2))
    for _ in range(5):
        step(sched)  # the heavy tenant's prefills fill every step
    sched.add(make_request("light", 16, tenant="light", max_tokens=2))
    out = step(sched)
    assert "light" in scheduled_ids(out)
    assert dict((r.request_id, n) for r, n in out.scheduled)["light"] == 16
    out = step(sched)
    assert "light" in scheduled_ids(out)  # its first decode


def test_without_tenants_the_light_prompt_waits_behind_the_queue() -> None:
    # The same load from one (anonymous) tenant: FIFO, as before.
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=64, num_blocks=4096)
    for i in range(16):
        sched.add(make_request(f"heavy{i}", 512, max_tokens=2))
    for _ in range(5):
        step(sched)
    sched.add(make_request("light", 16, max_tokens=2))
    waited = 0
    while "light" not in scheduled_ids(step(sched)):
        waited += 1
    assert waited > 100


def test_backlogged_tenants_share_the_prefill_budget_about_equally() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=64, num_blocks=8192)
    for i in range(8):
        sched.add(make_request(f"a{i}", 1024, tenant="a", max_tokens=1))
    for i in range(32):  # many short prompts: the share is in tokens, not requests
        sched.add(make_request(f"b{i}", 64, tenant="b", max_tokens=1))
    given = {"a": 0, "b": 0}
    for _ in range(30):
        for req, n in step(sched).scheduled:
            given[req.tenant] += n
    assert sum(given.values()) == 30 * 64
    assert abs(given["a"] - given["b"]) <= 2 * 64, given


def test_within_a_tenant_requests_are_prefilled_in_arrival_order() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(4):
        sched.add(make_request(f"t{i}", 40, tenant="t", max_tokens=1))
    sched.add(make_request("other", 8, tenant="u", max_tokens=1))
    first_scheduled: list[str] = []
    for out in run_to_completion(sched):
        for rid in scheduled_ids(out):
            if rid not in first_scheduled:
                first_scheduled.append(rid)
    assert [r for r in first_scheduled if r.startswith("t")] == ["t0", "t1", "t2", "t3"]
    assert first_scheduled.index("other") <= 1


def test_priority_still_comes_before_fair_share() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8)
    sched.add(make_request("served-less", 16, tenant="new", priority=5, max_tokens=1))
    sched.add(make_request("urgent", 16, tenant="busy", priority=0, max_tokens=1))
    sched.service.charge("busy", 10_000, sched.step_count)
    assert scheduled_ids(step(sched)) == ["urgent"]


def test_tenant_service_decays_by_half_per_half_life_and_forgets_idle_tenants() -> None:
    service = TenantService(half_life_steps=10)
    service.charge("a", 1000, step=0)
    assert abs(service.served("a", 10) - 500) < 1e-6
    assert abs(service.served("a", 20) - 250) < 1e-6
    service.charge("a", 100, step=20)
    assert abs(service.served("a", 20) - 350) < 1e-6
    service.forget_idle(step=200)  # 350 / 2**18 < 1 token
    assert len(service) == 0 and service.served("a", 200) == 0.0
