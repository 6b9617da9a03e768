"""A hosted pool's provider limits: its tokens-per-minute budget over a sliding minute, and
the provider's word on its answers (x-ratelimit-*, 429 with Retry-After)."""

import pytest

from gateway.capacity.provider import ProviderLimits, parse_duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1m30.5s", 90.5), ("2", 2.0), ("7h", 900.0)],
)
def test_provider_durations_parse_and_are_bounded(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [None, "", "soon", "-1", "1x", "nan", "1s junk"])
def test_what_is_not_a_duration_is_none(text):
    assert parse_duration(text) is None


def test_the_budget_admits_until_spent_then_says_when_enough_frees():
    clock = Clock()
    limits = ProviderLimits(1000, clock)
    assert limits.wait_s(600) == (0.0, "")
    limits.charge(600)
    clock.now += 10
    limits.charge(300)
    wait, why = limits.wait_s(200)  # 900 spent: 200 more needs the first 600 to expire
    assert wait == pytest.approx(50.0) and "1000 tokens a minute" in why
    assert limits.wait_s(100) == (0.0, "")
    clock.now += 50
    assert limits.wait_s(200) == (0.0, "")
    assert limits.wait_s(2000)[0] == 60.0  # never fits: a minute, and it says why


def test_a_group_member_holds_its_share_of_the_budget():
    assert ProviderLimits(1000, Clock(), share=0.25).budget == 250


def test_the_providers_word_blocks_until_its_reset():
    clock = Clock()
    limits = ProviderLimits(None, clock)
    limits.note_answer(
        200, {"x-ratelimit-remaining-tokens": "50", "x-ratelimit-reset-tokens": "2s"}
    )
    assert limits.wait_s(40) == (0.0, "")
    limits.charge(40)
    wait, why = limits.wait_s(40)  # 10 left by its count and ours
    assert wait == pytest.approx(2.0) and "tokens left" in why
    clock.now += 2
    assert limits.wait_s(40) == (0.0, "")
    limits.note_answer(
        200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s"}
    )
    assert limits.wait_s(1) == (pytest.approx(1.5), "no requests left until its reset")
    clock.now += 2
    limits.note_answer(429, {"retry-after-ms": "700"})
    assert limits.wait_s(1) == (pytest.approx(0.7), "it answered 429")
    clock.now += 1
    limits.note_answer(429, {"retry-after": "3"})
    assert limits.wait_s(1)[0] == pytest.approx(3.0)
