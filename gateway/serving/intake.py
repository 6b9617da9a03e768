"""From an HTTP request to a `Plan`: authenticate the key, decode the body once, then
route, count and bound it with the pure functions of `gateway.serving.plan`.

Counting grows with the prompt, so it is bounded by the context the request may use
(`PromptTooLong`, before tokenizing) and, for a body over `count_inline_bytes`, runs on the
gateway's `CountingPool` (threads, fair by tenant), never on the event loop."""

import asyncio
import functools
import logging
import time
import uuid
from typing import Any

import msgspec
from litestar import Request

from cascade.policy import escalation_for
from gateway.capacity.door import KEY_DIGEST, key_digest
from gateway.config import GatewayConfig
from gateway.gateway import Caller, Gateway
from gateway.serving.plan import (
    GatewayChatRequest,
    GatewayCompletionRequest,
    Plan,
    PublicRequest,
    affinity_of,
    check_context,
    check_upstream_fields,
    client_logprobs,
    is_structured,
    max_tokens_of,
    prompt_room,
    timeout_of,
)
from gateway.serving.prompt_tokens import PromptTooLong
from quota.budget import Budget
from quota.keyspace import key_quota_id
from quota.limiter import RateLimitState
from quota.models import Tenant, TenantLimits
from workers.api.types import ApiError, decode_request
from workers.api.upstreams.registry import adapter_for
from workers.api.validation import check_json_depth, check_request

log = logging.getLogger(__name__)


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
    """The caller's key id and tenant (see `authenticate_caller`)."""
    key_id, tenant, _ = await authenticate_caller(gw, request)
    return key_id, tenant


async def authenticate_caller(gw: Gateway, request: Request) -> Caller:
    """The caller's key id, tenant and the key's own limits. A key that authenticated in
    the last `key_cache_ttl_s` is taken as it was then (no Redis round trip); so revoking a
    key, or changing limits, applies within that. While Redis is unreachable,
    only a key that authenticated in the last `known_key_ttl_s` is accepted (as it was
    then): never an unknown key.

    The key's digest is the door's (`gateway.capacity.door.KEY_DIGEST` in the scope), or,
    with no door in front, computed here by the same `key_digest`."""
    digest = request.scope.get(KEY_DIGEST)
    if digest is None:
        digest = key_digest(request.headers.get("authorization", "").encode("latin-1"))
        if digest is None:
            raise ApiError(
                401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
    cached = gw.known_keys.get(digest)
    if (
        cached is not None
        and cached[1] > gw.keys_changed_at
        and time.monotonic() - cached[1] < gw.config.key_cache_ttl_s
    ):
        return cached[0]  # authenticated against Redis within the last key_cache_ttl_s
    # Every request of a busy key misses at once when its entry ages: one lookup, in a
    # task of its own (a caller that leaves does not cancel it for the others).
    lookup = gw.key_lookups.get(digest)
    if lookup is None:
        plaintext = request.headers["authorization"][7:].strip()
        lookup = asyncio.ensure_future(_look_up_key(gw, plaintext, digest, cached))
        gw.key_lookups[digest] = lookup

        def looked_up(task: asyncio.Future[Caller]) -> None:
            gw.key_lookups.pop(digest, None)
            if not task.cancelled():
                task.exception()  # retrieved, even if every caller left

        lookup.add_done_callback(looked_up)
    return await asyncio.shield(lookup)


async def _look_up_key(
    gw: Gateway, plaintext: str, digest: bytes, cached: tuple[Caller, float] | None
) -> Caller:
    """The key's caller from Redis (and into the cache); see `authenticate_caller`."""
    t0 = time.perf_counter()
    try:
        found = await gw.store.authenticate(plaintext)
        if gw.metrics is not None:
            gw.metrics.redis_latency.labels("auth").observe(time.perf_counter() - t0)
    except Exception as exc:
        if gw.metrics is not None:
            gw.metrics.redis_errors.labels("auth").inc()
        if cached is not None and time.monotonic() - cached[1] < gw.config.known_key_ttl_s:
            return cached[0]  # (key id, tenant, key limits) as last seen
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
    record, tenant = found
    holder = None
    if record.limits is not None or record.budget is not None:
        holder = key_quota_holder(tenant, record.key_id, record.limits, record.budget)
    caller = (record.key_id, tenant, holder)
    gw.known_keys[digest] = (caller, time.monotonic())
    return caller


def key_quota_holder(
    tenant: Tenant, key_id: str, limits: TenantLimits | None, budget: Budget | None = None
) -> Tenant:
    """A key's own limits and budget as a quota holder of their own: its windows, slots,
    spend and pending records live under `sy:{key.<key_id>}`, apart from its tenant's."""
    return Tenant(
        tenant_id=key_quota_id(key_id),
        name=f"key {key_id} of {tenant.tenant_id}",
        limits=limits if limits is not None else TenantLimits(),
        allowed_models=[],
        allow_overflow=True,
        created_at=0.0,
        budget=budget,
    )


# Worker fields only the gateway sends (gateway/serving/resume.py).
GATEWAY_ONLY_FIELDS = ("resume_token_ids", "resume_text_chars", "return_token_ids")


def decode(raw: bytes, chat: bool, cfg: GatewayConfig) -> PublicRequest:
    """The body as a typed request, or a 4xx naming what is wrong: size first, then nesting
    depth (before any parser recurses), then types, then bounds that need no model."""
    if len(raw) > cfg.max_body_bytes:
        raise ApiError(
            413, f"request body over {cfg.max_body_bytes} bytes", code="request_too_large"
        )
    check_json_depth(raw, cfg.request_limits.max_json_depth)
    req = decode_request(raw, GatewayChatRequest if chat else GatewayCompletionRequest)
    for name in GATEWAY_ONLY_FIELDS:
        if getattr(req, name):
            raise ApiError(
                400,
                f"`{name}` is set by the gateway (a stream resumed on another replica), "
                "not by a client",
                param=name,
                code="unknown_field",
            )
    check_request(req, cfg.request_limits, vocab_size=None, max_model_len=None)
    if req.switchyard_threshold is not None and not 0 <= req.switchyard_threshold <= 1:
        raise ApiError(
            400, "switchyard_threshold must be between 0 and 1", param="switchyard_threshold"
        )
    return req


async def prepare(
    gw: Gateway,
    tenant: Tenant,
    key_id: str | None,
    req: PublicRequest,
    chat: bool,
    timeout_header: str | None,
    *,
    body_bytes: int = 0,
    key_max_context: int | None = None,
) -> Plan:
    """Route, count, bound and price a decoded request (pure decisions, fed by the
    tokenizers, the router and the pools' reported limits). `body_bytes`: the size of the
    body it was decoded from (a big one is counted off the loop); `key_max_context`: the
    key's own context limit, beside its tenant's."""
    cfg = gw.config
    timeout_s = timeout_of(timeout_header, cfg.request_timeout_s)
    max_tokens = max_tokens_of(req, cfg.default_max_tokens, cfg.max_tokens_cap)
    pool, route, decision = req.model, "forced", None
    if req.model == "auto":
        if gw.router is not None:
            decision = _decide(gw, tenant, key_id, req, max_tokens)
            pool, route = decision.pool, decision.route
        elif cfg.default_pool is not None:
            pool, route = cfg.default_pool, "fallback"
        else:
            raise ApiError(
                404,
                "model `auto` is not configured on this gateway",
                param="model",
                code="model_not_found",
            )
    if pool not in gw.pools:
        raise ApiError(
            404,
            f"unknown model {req.model!r}; try one of {sorted(gw.pools)}",
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
    check_upstream_fields(req, pool, gw.pools[pool].kind)
    vocab_size, model_len = gw.pools[pool].model_limits()
    check_request(
        req,
        cfg.request_limits,
        vocab_size=vocab_size,
        max_model_len=model_len,
        default_max_tokens=cfg.default_max_tokens,  # what the worker will be sent
    )
    limits = (tenant.limits.max_context, key_max_context)
    own_limit = min((limit for limit in limits if limit is not None), default=None)
    room = prompt_room(max_tokens, own_limit, model_len)
    try:
        prompt_tokens = await count_prompt(gw, tenant.tenant_id, pool, req, room, body_bytes)
        counted = True
    except PromptTooLong as exc:  # a lower bound, over the room: check_context refuses it
        prompt_tokens, counted = exc.min_tokens, False
    if counted and room is not None and prompt_tokens > SERVER_COUNT_FRACTION * room:
        # An estimate near the context limit: the foreign server's own count decides.
        exact = await server_count(gw, pool, req)
        if exact is not None:
            prompt_tokens = exact
    check_context(prompt_tokens, max_tokens, own_limit, model_len, at_least=not counted)
    if req.priority < tenant.priority_ceiling:
        raise ApiError(
            403,
            f"priority {req.priority} is more urgent than this tenant may ask (its ceiling is "
            f"{tenant.priority_ceiling}; lower is more urgent)",
            type="permission_error",
            param="priority",
            code="priority_not_allowed",
        )
    escalation = None
    if decision is not None and decision.route == "classifier" and pool == gw.router.small_pool:
        chosen = escalation_for(gw.router.settings, tenant.tenant_id)
        # At its spend target a tenant's unsure answers are not re-run on the large pool.
        saving = (gw.spend.fraction_of_target(tenant.tenant_id, tenant.budget) or 0.0) >= 1.0
        if chosen.enabled and not req.stream and not saving:
            escalation = chosen
    return Plan(
        request_id=f"gw-{uuid.uuid4().hex}",
        tenant_id=tenant.tenant_id,
        pool=pool,
        route=route,
        chat=chat,
        stream=req.stream,
        wants_usage=bool(req.stream_options and req.stream_options.include_usage),
        client_logprobs=client_logprobs(req),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        deadline=time.monotonic() + timeout_s,
        affinity=affinity_of(req),
        score=decision.score if decision else None,
        threshold=decision.threshold if decision else None,
        escalation=escalation,
        n=req.n,
        structured=is_structured(req),
        priority=req.priority,
    )


# A pool counted by estimate asks its server for the exact count when the estimate passes
# this fraction of the room the context leaves the prompt: the estimate (3 bytes a token)
# errs long on English, and would refuse prompts that fit.
SERVER_COUNT_FRACTION = 0.5
SERVER_COUNT_TIMEOUT_S = 2.0


async def server_count(gw: Gateway, pool: str, req: PublicRequest) -> int | None:
    """The prompt's tokens by the pool's own server (a foreign kind's tokenize endpoint,
    through a ready member); None where the pool counts exactly already, its kind cannot
    say, or no member answers."""
    target = gw.pools[pool]
    if target.kind in ("switchyard", "auto") or gw.counter.exact_for(pool):
        return None
    member = next((v for v in target.views.values() if v.state == "ready"), None)
    if member is None:
        return None
    body = msgspec.to_builtins(msgspec.structs.replace(req, model=target.upstream_model or pool))

    async def post(url: str, payload: Any, timeout_s: float) -> tuple[int, Any]:
        return await gw.workers.post_json(url, payload, timeout_s)

    return await adapter_for(target.kind).count_prompt(
        post, member.url, body, SERVER_COUNT_TIMEOUT_S
    )


async def count_prompt(
    gw: Gateway,
    tenant_id: str,
    pool: str,
    req: PublicRequest,
    limit_tokens: int | None,
    body_bytes: int,
) -> int:
    """The request's prompt tokens as `pool`'s worker will count them (PromptTooLong when
    its bytes prove it over `limit_tokens`). A body up to `count_inline_bytes` is counted
    here, at once; a bigger one on the counting pool, where it waits behind its own
    tenant's counts only."""
    counter = gw.counter
    work: functools.partial[int]
    if isinstance(req, GatewayChatRequest):
        work = functools.partial(
            counter.chat, pool, req.messages, req.tools, req.tool_choice, limit_tokens
        )
    else:
        work = functools.partial(counter.completion, pool, req.prompt, limit_tokens)
    if gw.counting is None or body_bytes <= gw.config.count_inline_bytes:
        return work()
    return await gw.counting.run(tenant_id, work)


def _decide(gw: Gateway, tenant: Tenant, key_id: str | None, req: PublicRequest, max_tokens: int):
    """The cascade's choice for an `auto` request, with the large pool's pressure."""
    router = gw.router
    large = gw.pools[router.large_pool]
    if isinstance(req, GatewayChatRequest):
        messages, prompt = [msgspec.structs.asdict(m) for m in req.messages], ""
        text_bytes = sum(len(m.content) for m in req.messages if isinstance(m.content, str))
    else:
        messages, prompt = None, req.prompt if isinstance(req.prompt, str) else ""
        text_bytes = len(prompt) if prompt else len(req.prompt) * 3
    # Full, or predicted to miss its TTFT target (prompt tokens estimated from the text;
    # they are counted once the pool is chosen): the large pool is under pressure.
    pressed = len(large.queue) >= large.queue_config.max_requests or large.would_miss(
        tenant.tenant_id, text_bytes // 3, max_tokens, req.priority
    )
    return router.decide(
        tenant.tenant_id,
        tenant.allow_overflow,
        prompt,
        messages,
        max_tokens,
        large.estimated_wait_s(),
        pressed,
        request_threshold=req.switchyard_threshold,
        structured=is_structured(req),
        key_threshold=router.settings.key_thresholds.get(key_id) if key_id else None,
        spend_fraction=gw.spend.fraction_of_target(tenant.tenant_id, tenant.budget),
    )
