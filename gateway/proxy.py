"""The public request flow: authenticate, validate, reserve tokens, queue, dispatch, relay,
reconcile. Every path that reserved tokens reconciles them exactly once."""

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from litestar import Request, Response

from gateway.admission import Ticket
from gateway.balancer import prefix_key
from gateway.context import Gateway
from gateway.errors import error_response, to_api_error
from gateway.relay import Attempt, Dispatcher, WorkerRefused, relay_events
from gateway.sse import EventStream
from quota.limiter import RateLimitState, Reservation
from quota.models import Tenant
from workers.api import ApiError

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request, ready to reserve and queue."""

    request_id: str
    tenant: Tenant
    pool: str
    route: str
    body: dict[str, Any]
    stream: bool
    wants_usage: bool
    prompt_tokens: int
    max_tokens: int
    affinity: bytes | None
    deadline: float


def ratelimit_headers(state: RateLimitState | None) -> dict[str, str]:
    if state is None:
        return {}
    out = {}
    for kind in ("tokens", "requests"):
        limit = getattr(state, f"limit_{kind}")
        if limit is None:
            continue
        out[f"x-ratelimit-limit-{kind}"] = str(limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(getattr(state, f"remaining_{kind}"))
        reset = getattr(state, f"reset_{kind}_s")
        out[f"x-ratelimit-reset-{kind}"] = f"{reset:.3f}s" if reset is not None else "0s"
    return out


async def authenticate(gw: Gateway, request: Request) -> Tenant:
    """The caller's tenant. While Redis is unreachable, only a key that authenticated in
    the last `known_key_ttl_s` is accepted (as it was then): never an unknown key."""
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer "):
        raise ApiError(
            401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
        )
    plaintext = header[7:].strip()
    digest = hashlib.blake2b(plaintext.encode(), digest_size=16).digest()
    try:
        found = await gw.store.authenticate(plaintext)
    except Exception as exc:
        cached = gw.known_keys.get(digest)
        if cached is not None and time.monotonic() - cached[1] < gw.config.known_key_ttl_s:
            return cached[0]
        log.warning("key lookup failed and the key is not known: %r", exc)
        raise ApiError(
            503,
            "authentication unavailable",
            type="server_error",
            code="auth_unavailable",
            retry_after_s=1.0 + gw.rng.random(),
        ) from exc
    if found is None:
        gw.known_keys.pop(digest, None)
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    if len(gw.known_keys) > 100_000:
        gw.known_keys.clear()
    gw.known_keys[digest] = (found[1], time.monotonic())
    return found[1]


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < lo
        or (hi is not None and value > hi)
    ):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ApiError(400, f"{name} must be an integer {bound}", param=name)
    return value


def prepare(
    gw: Gateway, tenant: Tenant, raw: bytes, chat: bool, timeout_header: str | None
) -> Prepared:
    cfg = gw.config
    if len(raw) > cfg.max_body_bytes:
        raise ApiError(
            413, f"request body over {cfg.max_body_bytes} bytes", code="request_too_large"
        )
    try:
        body = msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required (a pool name or `auto`)", param="model")
    route = "forced"
    pool = model
    if model == "auto":
        if cfg.default_pool is None:
            raise ApiError(
                404,
                "model `auto` is not configured on this gateway",
                param="model",
                code="model_not_found",
            )
        pool, route = cfg.default_pool, "fallback"
    if pool not in gw.pools:
        raise ApiError(
            404,
            f"unknown model {model!r}; try one of {sorted(gw.pools)}",
            param="model",
            code="model_not_found",
        )
    if tenant.allowed_models and pool not in tenant.allowed_models:
        raise ApiError(
            403,
            f"model {pool!r} is not allowed for this key",
            param="model",
            code="model_not_allowed",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int_field(body, name, 1, cfg.max_tokens_cap)
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
        body["max_tokens"] = max_tokens
    if chat:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise ApiError(400, "messages must be a non-empty list of objects", param="messages")
        prompt_tokens = gw.counter.chat(pool, messages)
        first = messages[0].get("content") if messages[0].get("role") == "system" else None
        affinity = prefix_key(first) if isinstance(first, str) and first else None
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        prompt_tokens = gw.counter.completion(pool, prompt)
        affinity = (
            prefix_key(prompt if isinstance(prompt, str) else prompt[:256]) if prompt else None
        )
    limit = tenant.limits.max_context
    if limit is not None and prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds this key's "
            f"context limit of {limit}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    timeout = cfg.request_timeout_s
    if timeout_header:
        try:
            timeout = min(float(timeout_header), cfg.request_timeout_s)
        except ValueError:
            raise ApiError(400, "x-request-timeout must be a number of seconds") from None
    wants_usage = bool(
        isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["model"] = pool
    body["cache_salt"] = gw.cache_salt(tenant.tenant_id)
    return Prepared(
        request_id=f"gw-{uuid.uuid4().hex}",
        tenant=tenant,
        pool=pool,
        route=route,
        body=body,
        stream=stream,
        wants_usage=wants_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        affinity=affinity,
        deadline=time.monotonic() + timeout,
    )


def _charge(prep: Prepared, attempt: Attempt, dispatched: bool) -> int:
    """Tokens to charge: the worker's usage; else the prompt plus what was generated once
    dispatched (a client that left after dispatch still pays its prompt); else nothing."""
    if attempt.usage_seen:
        return (attempt.prompt_tokens or prep.prompt_tokens) + attempt.completion_tokens
    return prep.prompt_tokens + attempt.completion_tokens if dispatched else 0


async def handle(gw: Gateway, request: Request, chat: bool) -> Response | EventStream:
    """One public request, counted by pool, route and status."""
    t0 = time.perf_counter()
    labels = ["-", "-"]
    status = 500
    try:
        response = await _handle(gw, request, chat, labels)
        status = response.status_code
        return response
    except Exception as exc:
        status = to_api_error(exc, gw.rng).status
        raise
    finally:
        if gw.metrics is not None:
            gw.metrics.requests.labels(labels[0], labels[1], str(status)).inc()
            if labels[0] != "-":
                gw.metrics.latency.labels(labels[0]).observe(time.perf_counter() - t0)


async def _handle(
    gw: Gateway, request: Request, chat: bool, labels: list[str]
) -> Response | EventStream:
    tenant = await authenticate(gw, request)
    prep = prepare(gw, tenant, await request.body(), chat, request.headers.get("x-request-timeout"))
    labels[:] = [prep.pool, prep.route]
    cost = prep.prompt_tokens + prep.max_tokens
    reservation, state = await gw.limiter.reserve(tenant, prep.request_id, cost)
    headers = {
        "x-request-id": prep.request_id,
        "x-switchyard-model": prep.pool,
        "x-switchyard-route": prep.route,
        **ratelimit_headers(state),
    }
    pool = gw.pools[prep.pool]
    ticket = Ticket(prep.request_id, tenant.tenant_id, cost, time.monotonic(), prep.deadline)
    admitted = asyncio.ensure_future(pool.admit(ticket, prep.affinity))
    if gw.metrics is not None:
        wait = gw.metrics.queue_wait.labels(prep.pool)
        admitted.add_done_callback(lambda _: wait.observe(time.monotonic() - ticket.enqueued_at))
    await asyncio.sleep(0)  # a full queue refuses at once, before any response starts
    if admitted.done() and admitted.exception() is not None:
        gw.reconcile_later(reservation, 0)
        return error_response(to_api_error(admitted.exception(), gw.rng), headers)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload = msgspec.json.encode(prep.body)
    if prep.stream:
        events = _stream(gw, prep, reservation, admitted, path, payload)
        return EventStream(events, headers={**headers, "cache-control": "no-cache"})
    return await _json(gw, prep, reservation, admitted, path, payload, headers)


async def _json(gw, prep, reservation, admitted, path, payload, headers) -> Response:
    attempt = Attempt()
    dispatched = False
    pool = gw.pools[prep.pool]
    try:
        attempt.claimed = await admitted
        dispatched = True
        r = await Dispatcher(
            pool, gw.config.dispatch_attempts, gw.config.worker_retry_after_cap_s, gw.rng
        ).post_json(path, payload, prep.affinity, attempt)
        out_headers = {**headers}
        return Response(
            content=r.content,
            status_code=r.status_code,
            headers=out_headers,
            media_type="application/json",
        )
    except (WorkerRefused, httpx.HTTPError) as exc:
        err = ApiError(
            503,
            f"no replica of {prep.pool} could serve the request: {exc}",
            type="server_error",
            code="upstream_unavailable",
            retry_after_s=1.0 + gw.rng.random(),
        )
        return error_response(err, headers)
    except Exception as exc:
        return error_response(to_api_error(exc, gw.rng), headers)
    finally:
        _finish(pool, attempt, dispatched, admitted)
        gw.reconcile_later(reservation, _charge(prep, attempt, dispatched))


async def _stream(gw, prep: Prepared, reservation: Reservation, admitted, path, payload):
    attempt = Attempt()
    dispatched = False
    pool = gw.pools[prep.pool]
    upstream = None
    try:
        while not admitted.done():
            done, _ = await asyncio.wait({admitted}, timeout=gw.config.sse_heartbeat_s)
            if not done:
                yield b": queued\n\n"
        try:
            attempt.claimed = admitted.result()
        except Exception as exc:
            yield _error_event(to_api_error(exc, gw.rng))
            return
        dispatched = True
        dispatcher = Dispatcher(
            pool, gw.config.dispatch_attempts, gw.config.worker_retry_after_cap_s, gw.rng
        )
        try:
            upstream = await dispatcher.open_stream(path, payload, prep.affinity, attempt)
        except (WorkerRefused, httpx.HTTPError) as exc:
            yield _error_event(
                ApiError(
                    503,
                    f"no replica of {prep.pool} could serve the request: {exc}",
                    type="server_error",
                    code="upstream_unavailable",
                )
            )
            return
        if upstream.status_code != 200:
            yield _error_event_raw(await upstream.aread())
            return
        try:
            async for event in relay_events(upstream, attempt, prep.wants_usage):
                yield event
        except httpx.HTTPError as exc:
            log.warning(
                "worker %s died mid-stream: %r", attempt.worker.url if attempt.worker else "?", exc
            )
            yield _error_event(
                ApiError(
                    502,
                    "the model server failed mid-stream",
                    type="server_error",
                    code="upstream_failed",
                )
            )
    finally:
        if upstream is not None:
            # Closing the connection is what tells the worker to abort; shielded because
            # a disconnecting client cancels this generator.
            try:
                await asyncio.shield(upstream.aclose())
            except asyncio.CancelledError:
                pass
        _finish(pool, attempt, dispatched, admitted)
        gw.reconcile_later(reservation, _charge(prep, attempt, dispatched))


def _finish(pool, attempt: Attempt, dispatched: bool, admitted: asyncio.Future) -> None:
    """Give back the worker slot (or the queue's turn) this request held."""
    if not admitted.done():
        admitted.cancel()  # still queued: leave the queue
    elif not dispatched and not admitted.cancelled() and admitted.exception() is None:
        attempt.claimed = admitted.result()  # admitted, but the client left first
        dispatched = True
    if attempt.worker is not None:
        pool.end(attempt.worker)
    elif attempt.claimed is not None:
        pool.end(attempt.claimed)
    elif dispatched and not attempt.tried:
        pool.controller.release()


def _error_event(err: ApiError) -> bytes:
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\ndata: [DONE]\n\n"


def _error_event_raw(body: bytes) -> bytes:
    return b"data: " + body.strip() + b"\n\ndata: [DONE]\n\n"
