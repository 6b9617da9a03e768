"""The gateway's Litestar app: the composition of routes over a built `Gateway`."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from litestar import Litestar, Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api.admin import (
    FleetController,
    KeyController,
    PriceController,
    RoutingController,
    TenantController,
)
from gateway.api.admin_base import gateway_state
from gateway.api.dashboard import dashboard_routes
from gateway.api.learning import ClassifierController, learning_routes
from gateway.api.usage import UsageController, usage_routes
from gateway.capacity.door import LoopMonitor, door_middleware
from gateway.errors import exception_handlers
from gateway.gateway import Gateway
from gateway.metrics import MetricsAccess
from gateway.runtime.group_metrics import ProcessMetrics
from gateway.serving.handler import handle
from gateway.serving.intake import authenticate
from gateway.serving.messages_edge import messages_front, serve_messages
from gateway.serving.responses_edge import delete_response, get_response, serve_responses
from workers.api.types import ApiError

log = logging.getLogger(__name__)


def create_gateway_app(gw: Gateway, process_metrics: ProcessMetrics | None = None) -> Litestar:
    """The app over `gw`. `process_metrics`: this is one process of several on one port,
    and /metrics answers for all of them (gateway/runtime/group_metrics.py)."""

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        return await handle(gw, request, chat=True)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        return await handle(gw, request, chat=False)

    @post("/v1/messages", status_code=200)
    async def messages(request: Request) -> Any:
        """The Anthropic Messages API over the chat path (gateway/serving/messages_edge.py)."""
        return await serve_messages(gw, request)

    @post("/v1/responses", status_code=200)
    async def responses(request: Request) -> Any:
        """The OpenAI Responses API over the chat path (gateway/serving/responses_edge.py)."""
        return await serve_responses(gw, request)

    @get("/v1/responses/{response_id:str}")
    async def stored_response(request: Request, response_id: FromPath[str]) -> dict[str, Any]:
        tenant = await authenticate(gw, request)
        return await get_response(gw, tenant.tenant_id, response_id)

    @delete("/v1/responses/{response_id:str}", status_code=200)
    async def deleted_response(request: Request, response_id: FromPath[str]) -> dict[str, Any]:
        tenant = await authenticate(gw, request)
        return await delete_response(gw, tenant.tenant_id, response_id)

    @get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant = await authenticate(gw, request)
        names = [p for p in gw.pools if not tenant.allowed_models or p in tenant.allowed_models]
        if gw.config.default_pool:
            names.append("auto")
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "switchyard"} for n in names]
        return {"object": "list", "data": data}

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready")
    async def ready() -> Response:
        ok = all(any(v.state == "ready" for v in p.views.values()) for p in gw.pools.values())
        try:
            await gw.redis.ping()
        except Exception:
            ok = False
        return Response(content={"ready": ok}, status_code=200 if ok else 503)

    access = MetricsAccess(gw.config.metrics_token, gw.config.metrics_networks)

    def metrics_reader(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        """Guard: 401 (`metrics_unauthorized`) unless `access` allows the request."""
        peer = connection.client.host if connection.client else None
        if not access.allows(peer, connection.headers.get("authorization", "")):
            raise ApiError(
                401,
                "/metrics answers the metrics token (Authorization: Bearer) or the "
                "metrics_networks only",
                code="metrics_unauthorized",
            )

    @get("/metrics", guards=[metrics_reader])
    async def metrics() -> Response:
        if process_metrics is not None:
            content = await process_metrics.exposition()
        else:
            content = generate_latest(gw.registry)
        return Response(content=content, media_type=CONTENT_TYPE_LATEST)

    monitor, middleware = _door(gw)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if monitor is not None:
            monitor.start()
        if process_metrics is not None:
            await process_metrics.start()  # siblings may ask for this process's metrics
        poller = asyncio.ensure_future(_poll_loads(gw))
        members = asyncio.ensure_future(gw.membership.run()) if gw.membership else None
        demand = asyncio.ensure_future(gw.demand.run()) if gw.demand else None
        stop = asyncio.Event()
        upkeep = asyncio.ensure_future(
            gw.maintenance.run_forever(gw.config.quota_sweep_interval_s, stop)
        )
        try:
            yield
        finally:
            if process_metrics is not None:
                await process_metrics.close()
            # Requests still running were cancelled by the server's grace period; their
            # flights closed their upstreams and scheduled their reconciles.
            poller.cancel()
            if demand is not None:  # before membership's client closes: it withdraws
                demand.cancel()
                await asyncio.gather(demand, return_exceptions=True)
            if members is not None and gw.membership is not None:
                members.cancel()
                await asyncio.gather(members, return_exceptions=True)
                await gw.membership.store.redis.aclose()
            await gw.settle_all()
            stop.set()
            await asyncio.gather(upkeep, return_exceptions=True)
            await gw.maintenance.close()
            await gw.limiter.aclose()
            await gw.webhook.aclose()
            await gw.redis.aclose()
            await gw.workers.aclose()
            if monitor is not None:
                monitor.stop()

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            messages,
            responses,
            stored_response,
            deleted_response,
            models,
            *usage_routes(gw),
            *dashboard_routes(),
            health,
            ready,
            metrics,
            *learning_routes(gw),
            # The admin API: controllers behind the admin key, which find `gw` in the state.
            TenantController,
            KeyController,
            RoutingController,
            PriceController,
            FleetController,
            UsageController,
            ClassifierController,
        ],
        state=gateway_state(gw),
        exception_handlers=exception_handlers(gw.rng),
        # Messages requests: x-api-key (Anthropic's key header) as the bearer key, before
        # the door hashes it, and the door's refusals in Anthropic's error shape.
        middleware=[messages_front, *middleware],
        lifespan=[lifespan],
        request_max_body_size=gw.config.max_body_bytes * 2,
        # The process's own logging (`--log-level`, `--log-format`): Litestar's default
        # would replace the root handler with its queue handler and its own text format.
        logging_config=None,
        openapi_config=OpenAPIConfig(
            title="Switchyard gateway",
            version="0.1.0",
            description="OpenAI-compatible API, usage and the admin API (docs/admin-api.md). "
            "Served at /schema/openapi.json.",
        ),
    )


def _door(gw: Gateway) -> tuple[LoopMonitor, list]:
    """The door (gateway/capacity/door.py) over `gw.gate` as a middleware (none without a
    gate: `door` is off), and the loop monitor that ticks the gate and exports the loop's lag."""
    cfg, metrics, gate = gw.config, gw.metrics, gw.gate

    def on_tick(lag_s: float) -> None:
        if metrics is not None:
            metrics.loop_lag.set(lag_s)
        if gate is not None:
            gate.tick()
            if metrics is not None:
                metrics.door_limit.set(gate.limit)
                metrics.door_waiting.set(gate.waiting)

    monitor = LoopMonitor(on_tick=on_tick)
    if gate is None:
        return monitor, []

    def tenant_of(digest: bytes) -> str | None:
        known = gw.known_keys.get(digest)
        return known[0][1].tenant_id if known is not None else None

    def refused(tenant_id: str) -> None:
        if metrics is not None:
            metrics.door_refusals.labels(metrics.tenant(tenant_id)).inc()

    def middleware(app):  # noqa: ANN001, ANN202 (ASGI)
        return door_middleware(
            app,
            gate,
            tenant_of,
            on_refusal=refused,
            rng=gw.rng,
            refusal_delay_s=cfg.door_refusal_delay_s,
        )

    return monitor, [middleware]


async def _poll_loads(gw: Gateway) -> None:
    """Refresh every pool's view of its workers, forever."""
    while True:
        try:
            await asyncio.gather(*(pool.refresh() for pool in gw.pools.values()))
        except Exception:
            log.exception("load polling failed")
        await asyncio.sleep(gw.config.load_poll_interval_s)
