"""The leader lease's policy on a clock: taking, renewing at ttl/3, losing on expiry, and
fencing (a replaced leader's token is refused)."""

import pytest

from workers.fleet.lease import Fence, LeaseConfig, LeaseHolder

TTL = LeaseConfig(ttl_s=6.0, margin_s=0.5)


def test_a_contender_acquires_at_once_and_renews_every_third_of_the_ttl() -> None:
    holder = LeaseHolder(TTL, "a")
    assert holder.due(0.0) == "acquire"
    holder.acquired(token=1, sent_at_s=0.0)
    assert holder.is_leader(0.0)
    assert holder.due(1.9) is None  # not yet: renewals come every 2 s
    assert holder.due(2.0) == "renew"
    holder.renewed(sent_at_s=2.0)
    assert holder.due(3.9) is None and holder.due(4.0) == "renew"


def test_leadership_ends_before_the_key_can_expire_on_the_server() -> None:
    holder = LeaseHolder(TTL, "a")
    holder.acquired(token=7, sent_at_s=10.0)
    # The key expires 6 s after the call was sent; the holder stops 0.5 s earlier.
    assert holder.is_leader(15.49)
    assert not holder.is_leader(15.5)


def test_renewals_that_get_no_answer_lose_the_lease_when_its_validity_runs_out() -> None:
    holder = LeaseHolder(TTL, "a")
    holder.acquired(token=3, sent_at_s=0.0)
    t = 0.0
    while t < 5.5:
        if holder.due(t) == "renew":
            holder.failed(sent_at_s=t)  # Redis did not answer
        t = round(t + 0.1, 1)
    assert holder.is_leader(5.4)
    assert holder.due(5.5) == "acquire"  # dropped: it contends again, as anyone would
    assert holder.token is None and holder.num_lost == 1


def test_a_renewal_refused_loses_the_lease_at_once() -> None:
    holder = LeaseHolder(TTL, "a")
    holder.acquired(token=3, sent_at_s=0.0)
    holder.renewal_refused()
    assert not holder.is_leader(2.0)
    assert holder.due(2.0) == "acquire"


def test_a_late_reply_counts_from_when_the_call_was_sent() -> None:
    holder = LeaseHolder(TTL, "a")
    holder.acquired(token=1, sent_at_s=0.0)
    holder.renewed(sent_at_s=2.0)  # the reply came at 4.0: validity still from 2.0
    assert holder.is_leader(7.49) and not holder.is_leader(7.5)


def test_a_refused_contender_tries_again_when_the_holders_lease_would_expire() -> None:
    holder = LeaseHolder(TTL, "b")
    holder.refused(sent_at_s=1.0, remaining_s=0.7)
    assert holder.due(1.6) is None
    assert holder.due(1.71) == "acquire"
    # A longer remaining lease: still tries every renew interval (a release is seen soon).
    holder.refused(sent_at_s=2.0, remaining_s=5.0)
    assert holder.due(3.9) is None and holder.due(4.0) == "acquire"


def test_a_dead_leader_is_replaced_within_the_ttl_of_its_last_renewal() -> None:
    """Two contenders on one simulated Redis key: the leader renews until it dies at 9.0;
    the other takes over once the key expires, within ttl of the last renewal."""
    key: tuple[str, float] | None = None  # (holder, expires at)
    tokens = 0
    a, b = LeaseHolder(TTL, "a"), LeaseHolder(TTL, "b")
    alive = {"a": True, "b": True}
    last_renewal = {"a": 0.0}
    t = 0.0
    took_over_at = None
    while t < 30.0 and took_over_at is None:
        if t >= 9.0:
            alive["a"] = False
        for h in (a, b):
            if not alive[h.holder_id]:
                continue
            action = h.due(t)
            if key is not None and key[1] <= t:
                key = None  # expired on the server
            if action == "acquire":
                if key is None:
                    tokens += 1
                    key = (h.holder_id, t + TTL.ttl_s)
                    h.acquired(tokens, t)
                    if h is b:
                        took_over_at = t
                else:
                    h.refused(t, key[1] - t)
            elif action == "renew":
                if key is not None and key[0] == h.holder_id:
                    key = (h.holder_id, t + TTL.ttl_s)
                    h.renewed(t)
                    last_renewal[h.holder_id] = t
                else:
                    h.renewal_refused()
        t = round(t + 0.01, 2)
    assert a.token == 1 and b.token == 2
    assert took_over_at is not None
    assert took_over_at - last_renewal["a"] <= TTL.ttl_s + 0.02
    assert took_over_at - 9.0 <= TTL.ttl_s


def test_tenure_counts_from_the_take_and_resets_on_loss() -> None:
    holder = LeaseHolder(TTL, "a")
    holder.acquired(token=1, sent_at_s=4.0)
    holder.renewed(sent_at_s=6.0)
    assert holder.tenure_s(7.0) == pytest.approx(3.0)
    holder.renewal_refused()
    assert holder.tenure_s(7.0) == 0.0


def test_the_fence_refuses_a_token_below_the_highest_accepted() -> None:
    fence = Fence()
    assert fence.admit(3)
    assert fence.admit(3)  # the same leader's next order
    assert fence.admit(5)  # a newer leader
    assert not fence.admit(4)  # the replaced one, woken up
    assert fence.highest == 5 and fence.num_refused == 1


def test_a_margin_that_leaves_no_room_to_renew_is_refused() -> None:
    with pytest.raises(ValueError):
        LeaseConfig(ttl_s=3.0, margin_s=1.0)
