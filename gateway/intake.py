"""Turning an HTTP request into a validated, priced, routed `Prepared` request."""

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request

from cascade.policy import EscalationSettings, escalation_for
from gateway.balancer import prefix_key
from gateway.context import Gateway
from quota.limiter import RateLimitState
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
    score: float | None = None  # auto routing only
    threshold: float | None = None
    escalation: EscalationSettings | None = None  # set when an unsure small answer re-runs
    client_logprobs: bool = False


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
    return (await authenticate_key(gw, request))[1]


async def authenticate_key(gw: Gateway, request: Request) -> tuple[str | None, Tenant]:
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
            return cached[0]  # (key id, tenant) as last seen
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
    gw.known_keys[digest] = ((found[0].key_id, found[1]), time.monotonic())
    return found[0].key_id, found[1]


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
    gw: Gateway,
    tenant: Tenant,
    key_id: str | None,
    raw: bytes,
    chat: bool,
    timeout_header: str | None,
) -> Prepared:
    """Validate and price a request body; for `auto`, also decide its pool."""
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
    if model == "auto" and gw.router is None:
        if cfg.default_pool is None:
            raise ApiError(
                404,
                "model `auto` is not configured on this gateway",
                param="model",
                code="model_not_found",
            )
        pool, route = cfg.default_pool, "fallback"
    if model != "auto" and pool not in gw.pools:
        raise ApiError(
            404,
            f"unknown model {model!r}; try one of {sorted(gw.pools)}",
            param="model",
            code="model_not_found",
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
    decision = None
    if model == "auto" and gw.router is not None:
        decision = _decide(gw, tenant, key_id, body, chat, max_tokens)
        pool, route = decision.pool, decision.route
        if chat:
            prompt_tokens = gw.counter.chat(pool, body["messages"])
        else:
            prompt_tokens = gw.counter.completion(pool, body["prompt"])
    if tenant.allowed_models and pool not in tenant.allowed_models:
        raise ApiError(
            403,
            f"model {pool!r} is not allowed for this key",
            param="model",
            code="model_not_allowed",
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
    client_logprobs = body.get("logprobs") is True if chat else body.get("logprobs") is not None
    escalation = None
    if decision is not None and decision.route == "classifier" and pool == gw.router.small_pool:
        chosen = escalation_for(gw.router.settings, tenant.tenant_id)
        if chosen.enabled and not stream:
            escalation = chosen
            if chat:
                body["logprobs"] = True
            elif body.get("logprobs") is None:
                body["logprobs"] = 0
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
        score=decision.score if decision else None,
        threshold=decision.threshold if decision else None,
        escalation=escalation,
        client_logprobs=client_logprobs,
    )


def _decide(
    gw: Gateway,
    tenant: Tenant,
    key_id: str | None,
    body: dict[str, Any],
    chat: bool,
    max_tokens: int,
):
    """The cascade's choice for an `auto` request, with the large pool's pressure."""
    router = gw.router
    large = gw.pools[router.large_pool]
    messages = body["messages"] if chat else None
    prompt = "" if chat else (body["prompt"] if isinstance(body["prompt"], str) else "")
    raw = body.pop("switchyard_threshold", None)
    threshold = raw if isinstance(raw, int | float) and 0 <= raw <= 1 else None
    return router.decide(
        tenant.tenant_id,
        tenant.allow_overflow,
        prompt,
        messages,
        max_tokens,
        large.estimated_wait_s(),
        len(large.queue) >= large.queue_config.max_requests,
        request_threshold=threshold,
        key_threshold=router.settings.key_thresholds.get(key_id) if key_id else None,
    )
