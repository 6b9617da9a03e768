"""The flight settles when its `with` block ends, exactly once, however the block ends: its
leases released, pending work cancelled, late answers closed, and its outcome handed to the
gateway with the reservation."""

import asyncio
import math
import time
from contextlib import nullcontext

import pytest

from gateway.serving.flight import Flight
from gateway.serving.plan import Plan
from gateway.serving.record import RequestRecord
from quota.limiter import Reservation
from tests.unit.gateway.test_lease import inflight, make_pool


class Gw:
    """What a flight uses of the gateway: its pools, its set of flights, its reconciles."""

    def __init__(self) -> None:
        self.pools = {"small": make_pool()}
        self.flights: set = set()
        self.reconciled: list[tuple] = []  # (reservation, tokens, outcome)
        self.costs: list[int] = []  # nanos, beside each reconcile

    def reconcile_later(self, reservation, actual_tokens, outcome=None, cost_nanos=0) -> None:  # noqa: ANN001
        self.reconciled.append((reservation, actual_tokens, outcome))
        self.costs.append(cost_nanos)


def make_flight(gw: Gw, key: bool = False) -> Flight:
    plan = Plan(
        request_id="gw-1",
        tenant_id="acme",
        pool="small",
        route="forced",
        chat=False,
        stream=True,
        wants_usage=False,
        client_logprobs=False,
        prompt_tokens=4,
        max_tokens=10,
        deadline=math.inf,
        affinity=None,
    )
    record = RequestRecord("/v1/completions", time.perf_counter(), "acme", "k1", "small")
    return Flight(
        gw,
        plan,
        None,
        Reservation("acme", "gw-1", 14),
        record,
        {},
        key_reservation=Reservation("key.k1", "gw-1", 14) if key else None,
    )


class Upstream:
    status_code = 200
    is_closed = False

    def close(self) -> None:
        self.is_closed = True


@pytest.mark.parametrize("ending", ["answer", "error", "cancelled"])
def test_leaving_the_block_settles_once_however_it_ends(ending: str) -> None:
    gw = Gw()

    async def main() -> None:
        flight = make_flight(gw, key=True)
        raises = {
            "answer": nullcontext(),
            "error": pytest.raises(ValueError),
            "cancelled": pytest.raises(asyncio.CancelledError),
        }[ending]
        with raises:
            with flight:
                assert gw.flights == {flight}
                attempt = flight.attempt("small")
                await attempt.lease.wait()
                assert sum(inflight(gw.pools["small"])) == 1
                if ending == "answer":
                    flight.record.answer(200)
                elif ending == "error":
                    raise ValueError("a bug")
                else:
                    raise asyncio.CancelledError
        assert flight.settled and gw.flights == set()
        assert sum(inflight(gw.pools["small"])) == 0

    asyncio.run(main())
    (tenant, tokens, outcome), (key, key_tokens, key_outcome) = gw.reconciled
    assert tenant.tenant_id == "acme" and key.tenant_id == "key.k1"
    assert tokens == key_tokens == 0  # never dispatched: nothing charged
    assert key_outcome is None  # one usage record, with the tenant's reconcile
    assert outcome.key_id == "k1" and outcome.parts == ()
    # No answer began on an error or a cancelled task: the outcome says the client left.
    assert outcome.status == (200 if ending == "answer" else 499)


def test_a_stream_cut_mid_answer_is_charged_what_was_relayed_and_recorded_as_499() -> None:
    gw = Gw()

    async def main() -> Flight:
        with make_flight(gw) as flight:
            attempt = flight.attempt("small")
            await attempt.lease.wait()
            flight.track(attempt, Upstream())
            flight.record.answer(200)  # committed
            attempt.served.tokens_relayed = 3  # then the client left: no usage chunk
        return flight

    flight = asyncio.run(main())
    [(_, tokens, outcome)] = gw.reconciled
    assert tokens == 4 + 3 and outcome.status == 499
    assert outcome.parts[0].prompt_tokens == 4 and outcome.parts[0].completion_tokens == 3
    assert flight.record.status == 499 and flight.record.tokens == 7  # the access line's
    assert flight.attempts[0].upstream.is_closed  # the worker is told to abort


def test_settling_cancels_a_pending_dispatch_and_closes_an_answer_that_comes_after() -> None:
    gw = Gw()

    async def main() -> None:
        with make_flight(gw) as flight:
            attempt = flight.attempt("small")
            attempt.opening = asyncio.get_running_loop().create_future()
        assert attempt.opening.cancelled()
        late = Upstream()
        flight.track(attempt, late)  # an answer that was already on its way
        assert late.is_closed

    asyncio.run(main())
    assert len(gw.reconciled) == 1
