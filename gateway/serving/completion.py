"""Serving a non-streaming request: the answer raced against the client leaving (which
aborts the work at the worker) and a shutdown cut; escalation of an unsure small answer."""

import asyncio
import logging

import msgspec
from litestar import Request, Response

from cascade.policy import should_escalate
from gateway.errors import error_response, to_api_error
from gateway.gateway import Gateway
from gateway.serving.attempts import open_attempt, relayed_error
from gateway.serving.flight import Attempt, Flight
from gateway.serving.plan import note_usage, upstream_body
from workers.api.types import ApiError, parse_summary

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
    body = upstream_body(flight.req, plan, gw.cache_salt(plan.tenant_id), with_logprobs=escalate)
    upstream = await open_attempt(gw, flight, attempt, body, stream=False)
    if upstream.status_code != 200:
        return await relayed_error(upstream, headers)
    content = await upstream.aread()
    summary = parse_summary(content)
    if summary is not None:
        note_usage(attempt.served, summary.usage)
    if escalate:
        content = await _maybe_escalate(gw, flight, content, headers)
    elif gw.learner is not None:
        gw.learner.on_answer(gw, plan, flight.req, content)
    return Response(
        content=content, status_code=200, headers=headers, media_type="application/json"
    )


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
        body = upstream_body(
            flight.req,
            plan,
            gw.cache_salt(plan.tenant_id),
            pool=large,
            with_logprobs=plan.client_logprobs,
        )
        try:
            attempt = flight.attempt(large)
            upstream = await open_attempt(gw, flight, attempt, body, stream=False)
            if upstream.status_code == 200:
                large_content = await upstream.aread()
                summary = parse_summary(large_content)
                if summary is not None:
                    note_usage(attempt.served, summary.usage)
                answer = msgspec.json.decode(large_content)
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
        for choice in answer.get("choices", []):
            choice["logprobs"] = None
    return msgspec.json.encode(answer)


def token_logprobs(body: dict) -> list[float]:
    """Chosen-token log-probabilities of the first choice (chat or completions shape)."""
    choice = (body.get("choices") or [{}])[0]
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return [t["logprob"] for t in lp["content"] or []]
    return [x for x in lp.get("token_logprobs") or [] if x is not None]


def answer_text(body: dict) -> str:
    choice = (body.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("message") or {}).get("content") or ""
