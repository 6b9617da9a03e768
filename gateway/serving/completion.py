"""Serving a non-streaming request: the answer raced against the client leaving (which
aborts the work at the worker) and a shutdown cut; escalation of an unsure small answer.

A worker's body is read by the deadline and within `attempts.answer_bytes`; one that is
not a completion is a 502, and its usage is billed clamped (`plan.billed`): the client
is told what it is charged."""

import asyncio
import logging
import time

import msgspec
from litestar import Request, Response

from cascade.policy import should_escalate
from gateway.errors import error_response, to_api_error
from gateway.gateway import Gateway
from gateway.serving.attempts import answer_bytes, open_attempt, read_answer, relayed_error
from gateway.serving.flight import Attempt, Flight
from gateway.serving.plan import Plan, billed, counts, note_usage, with_usage_cost
from quota.budget import NANOS
from workers.api.client import UpstreamError, UpstreamResponse
from workers.api.types import ApiError, Usage, parse_summary

log = logging.getLogger("gateway.serving.handler")


async def json_response(
    gw: Gateway, request: Request, flight: Flight, attempt: Attempt, headers: dict[str, str]
) -> Response:
    work = asyncio.ensure_future(_complete(gw, flight, attempt, headers))
    gone = asyncio.ensure_future(_disconnected(request))
    aborting = flight.aborted
    try:
        done, _ = await asyncio.wait({work, gone, aborting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # the client left: closing the upstream aborts the work there
    if work not in done and aborting in done:
        return error_response(to_api_error(flight.abort_error, gw.rng), headers)
    if work not in done:
        # The client left while a worker held the request: it pays the prompt that
        # worker took in (the closed connection aborts the rest there).
        for a in flight.attempts:
            if a.upstream is None and a.lease.worker is not None and a.lease.tried:
                a.served.accepted = True
        return error_response(ApiError(499, "client disconnected"), headers)
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(
    gw: Gateway, flight: Flight, attempt: Attempt, headers: dict[str, str]
) -> Response:
    plan = flight.plan
    escalate = plan.escalation is not None
    body = gw.body_for(flight.req, plan, with_logprobs=escalate)
    upstream = await open_attempt(gw, flight, attempt, body, stream=False)
    if upstream.status_code != 200:
        return await relayed_error(upstream, plan, headers)
    content = await _answer(gw, flight, attempt, upstream)
    if escalate:
        content = await _maybe_escalate(gw, flight, content, headers)
    elif gw.learner is not None:
        gw.learner.on_answer(gw, plan, flight.req, content)
    if flight.prices:
        content = _with_cost(content, flight.cost_so_far(), headers)
    return Response(
        content=content, status_code=200, headers=headers, media_type="application/json"
    )


async def _answer(
    gw: Gateway, flight: Flight, attempt: Attempt, upstream: UpstreamResponse
) -> bytes:
    """The worker's 200 body, its usage noted on the attempt and, where the worker claimed
    more than the request could have produced, replaced by what it is billed. Raises
    UpstreamError for a body that is too large or not a completion, DeadlineExceeded."""
    plan = flight.plan
    content = await read_answer(upstream, plan, answer_bytes(gw, flight))
    summary = parse_summary(content)
    if summary is None:
        raise UpstreamError("the model server's answer is not a completion")
    note_usage(attempt.served, summary.usage)
    if summary.usage is not None and attempt.lease.worker is not None:
        attempt.lease.pool.record_service(
            attempt.lease.worker.url,
            summary.usage.prompt_tokens,
            summary.usage.completion_tokens,
            total_s=time.monotonic() - attempt.sent_at,
        )
    return _told(content, plan, attempt, summary.usage)


def _told(content: bytes, plan: Plan, attempt: Attempt, reported: Usage | None) -> bytes:
    bill = billed(plan, attempt.served)
    if reported is None or counts(reported) == counts(bill):
        return content
    answer = msgspec.json.decode(content)  # an object: parse_summary decoded it
    answer["usage"] = bill
    return msgspec.json.encode(answer)


def _with_cost(content: bytes, cost_nanos: int, headers: dict[str, str]) -> bytes:
    """The answer with what it cost (every attempt, in units of the gateway's currency) in
    `usage.cost` and the `x-switchyard-cost` header."""
    cost = cost_nanos / NANOS
    headers["x-switchyard-cost"] = repr(cost)
    spliced = with_usage_cost(content, cost)
    if spliced is not None:
        return spliced
    answer = msgspec.json.decode(content)
    if isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
        answer["usage"]["cost"] = cost
        return msgspec.json.encode(answer)
    return content


async def _maybe_escalate(
    gw: Gateway, flight: Flight, content: bytes, headers: dict[str, str]
) -> bytes:
    """Re-run on the large pool when the small model's answer is unsure (both attempts
    were reserved and are charged). The body to send, logprobs removed unless asked."""
    plan, router = flight.plan, gw.router
    small = msgspec.json.decode(content)
    answer = small
    if should_escalate(token_logprobs(small), plan.escalation):
        large = router.large_pool
        body = gw.body_for(flight.req, plan, pool=large, with_logprobs=plan.client_logprobs)
        try:
            attempt = flight.attempt(large)
            upstream = await open_attempt(gw, flight, attempt, body, stream=False)
            if upstream.status_code == 200:
                answer = msgspec.json.decode(await _answer(gw, flight, attempt, upstream))
                changed = answer_text(answer) != answer_text(small)
                router.metrics.escalations.labels("true" if changed else "false").inc()
                headers["x-switchyard-model"] = large
                headers["x-switchyard-route"] = "escalated"
                if gw.learner is not None:
                    gw.learner.on_escalation(gw, plan, flight.req, small, answer)
            else:
                log.warning("escalation of %s refused (%d)", plan.request_id, upstream.status_code)
        except Exception as exc:
            log.warning(
                "escalation of %s failed, keeping the small answer: %r", plan.request_id, exc
            )
    elif gw.learner is not None:
        gw.learner.on_answer(gw, plan, flight.req, content)
    if not plan.client_logprobs:
        for choice in _choices(answer):
            choice["logprobs"] = None
    return msgspec.json.encode(answer)


def _choices(body: object) -> list[dict]:
    """The answer's choices that are objects (a worker's answer is read defensively)."""
    choices = body.get("choices") if isinstance(body, dict) else None
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def token_logprobs(body: object) -> list[float]:
    """Chosen-token log-probabilities of the first choice (chat or completions shape);
    what is not a number is left out."""
    choices = _choices(body)
    lp = choices[0].get("logprobs") if choices else None
    if not isinstance(lp, dict):
        return []
    if "content" in lp:
        items = lp["content"] if isinstance(lp["content"], list) else []
        return [t["logprob"] for t in items if isinstance(t, dict) and _number(t.get("logprob"))]
    values = lp.get("token_logprobs")
    return [x for x in values if _number(x)] if isinstance(values, list) else []


def answer_text(body: object) -> str:
    choices = _choices(body)
    choice = choices[0] if choices else {}
    message = choice.get("message")
    text = choice.get("text") or (message.get("content") if isinstance(message, dict) else "")
    return text if isinstance(text, str) else ""
