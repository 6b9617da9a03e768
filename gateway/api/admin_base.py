"""What every admin controller shares: the `/admin` path, the admin-key guard, and the
`Gateway` as the dependency `gw` (kept in the app's state: `gateway_state`)."""

import hmac
from typing import Annotated

from litestar import Controller
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import HeaderParameter

from gateway.gateway import Gateway
from gateway.learning.router import Router
from workers.api.types import ApiError

_STATE_KEY = "gateway"

# A handler's `gw: GatewayDep` is the app's Gateway (AdminController.dependencies).
GatewayDep = NamedDependency[Gateway]
# Who made a change, for the routing and classifier audits.
AdminUser = Annotated[
    str, HeaderParameter(name="x-admin-user", description="recorded in the audit as who changed it")
]


def gateway_state(gw: Gateway) -> State:
    """The app state the admin controllers find `gw` in (Litestar(state=...))."""
    return State({_STATE_KEY: gw})


def provide_gateway(state: State) -> Gateway:
    return state[_STATE_KEY]


def is_admin(authorization: str, admin_key: str | None) -> bool:
    """Does an `Authorization` header carry `admin_key` (`Bearer <key>`, the scheme in any
    case)? Compared in constant time; with no admin key configured, nothing is."""
    if not admin_key:
        return False
    given = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
    return hmac.compare_digest(given.encode(), admin_key.encode())


def requires_admin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard: 401 (`invalid_admin_key`) unless the request carries the admin key."""
    gw = provide_gateway(connection.app.state)
    if not is_admin(connection.headers.get("authorization", ""), gw.config.admin_key):
        raise ApiError(401, "admin key required", code="invalid_admin_key")


class AdminController(Controller):
    """Base of the admin API's controllers: under /admin, behind the admin key."""

    path = "/admin"
    guards = [requires_admin]
    dependencies = {"gw": Provide(provide_gateway, sync_to_thread=False)}
    tags = ["admin"]


def cascade_of(gw: Gateway) -> Router:
    """The gateway's cascade router; 404 without one."""
    if gw.router is None:
        raise ApiError(
            404,
            "this gateway has no cascade (set cascade_small_pool and cascade_large_pool)",
            code="cascade_not_configured",
        )
    return gw.router
