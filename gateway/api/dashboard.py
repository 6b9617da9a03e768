"""`GET /dashboard`: the built-in usage page (static HTML and JS from `static/` here).

The page holds no data: it asks `/v1/usage` (a tenant key) or `/admin/usage` and
`/admin/fleet` (the admin key) with the key in the Authorization header, so what it can show
is exactly what the key may read. The key is kept in the tab's sessionStorage at most, never
in a URL; the page loads nothing from elsewhere (the CSP says so).
"""

from importlib import resources

from litestar import Response, get

_CSP = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "content-security-policy": _CSP,
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}


def _asset(name: str) -> str:
    return resources.files("gateway.api").joinpath("static", name).read_text()


def dashboard_routes() -> list:
    page = _asset("dashboard.html")
    script = _asset("dashboard.js")

    @get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(content=page, media_type="text/html", headers=_HEADERS)

    @get("/dashboard/app.js", include_in_schema=False)
    async def dashboard_js() -> Response:
        return Response(content=script, media_type="text/javascript", headers=_HEADERS)

    return [dashboard, dashboard_js]
