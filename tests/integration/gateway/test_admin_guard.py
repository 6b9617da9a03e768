"""The admin key guards every admin route of every controller the same way: no key, a
tenant's key, a wrong admin key or another scheme is a 401 in the OpenAI error shape, before
the route reads its body or looks anything up; with no admin key configured nothing gets in."""

import httpx
import pytest

from tests.integration.gateway.conftest import ADMIN

REFUSED = {
    "error": {
        "message": "admin key required",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_admin_key",
    }
}

# (method, path, body) over each admin controller: tenants, keys, routing, fleet, usage,
# classifiers and labels.
ADMIN_ROUTES = [
    ("POST", "/admin/tenants", {"tenant_id": "intruder"}),
    ("GET", "/admin/tenants", None),
    ("GET", "/admin/tenants/acme", None),
    ("PATCH", "/admin/tenants/acme", {"name": "taken"}),
    ("PUT", "/admin/tenants/acme", {}),
    ("DELETE", "/admin/tenants/acme", None),
    ("POST", "/admin/tenants/acme/keys", {"name": "stolen"}),
    ("GET", "/admin/tenants/acme/keys", None),
    ("DELETE", "/admin/keys/somekey", None),
    ("GET", "/admin/routing", None),
    ("PUT", "/admin/routing", {}),
    ("PATCH", "/admin/routing", {}),
    ("GET", "/admin/routing/audit", None),
    ("GET", "/admin/fleet", None),
    ("GET", "/admin/usage", None),
    ("GET", "/admin/usage?format=csv", None),
    ("GET", "/admin/routing/classifiers/acme", None),
    ("PUT", "/admin/routing/classifiers/acme", {"version": 1}),
    ("POST", "/admin/routing/classifiers/acme/rollback", None),
    ("DELETE", "/admin/routing/classifiers/acme", None),
    ("GET", "/admin/routing/labels/acme", None),
]


def _ask(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:  # noqa: ANN001
    return httpx.request(method, url + path, json=body, headers=headers)


def _assert_untouched(stack, key: str) -> None:  # noqa: ANN001
    with stack.admin() as c:
        assert [t["tenant_id"] for t in c.get("/admin/tenants").json()["data"]] == ["acme"]
        assert c.get("/admin/tenants/acme").json()["name"] == "acme"
        [listed] = c.get("/admin/tenants/acme/keys").json()["data"]
        assert key.startswith(listed["prefix"]) and not listed["revoked"]


def test_no_key_a_tenant_key_or_a_wrong_admin_key_is_401_on_every_admin_route(stack):
    key = stack.tenant("acme")
    credentials = [
        {},
        {"authorization": f"Bearer {key}"},
        {"authorization": f"Bearer {ADMIN}x"},
        {"authorization": f"Bearer {ADMIN[:-1]}"},
        {"authorization": f"Basic {ADMIN}"},
        {"authorization": ADMIN},
        {"authorization": "Bearer"},
    ]
    for headers in credentials:
        for method, path, body in ADMIN_ROUTES:
            r = _ask(stack.url, method, path, body, headers)
            assert r.status_code == 401, (headers, method, path, r.text)
            assert r.json() == REFUSED, (headers, method, path)
    _assert_untouched(stack, key)


def test_the_admin_key_is_taken_case_insensitively_after_bearer_and_stripped(stack):
    headers = {"authorization": f"bearer   {ADMIN}"}
    r = httpx.get(f"{stack.url}/admin/tenants", headers=headers)
    assert r.status_code == 200 and r.json() == {"data": []}


@pytest.mark.parametrize("configured", [None, ""])
def test_with_no_admin_key_configured_every_admin_route_is_401(stack, configured):
    key = stack.tenant("acme")
    stack.gateway.config.admin_key = configured
    try:
        for headers in ({}, {"authorization": "Bearer"}, {"authorization": f"Bearer {ADMIN}"}):
            for method, path, body in ADMIN_ROUTES:
                r = _ask(stack.url, method, path, body, headers)
                assert r.status_code == 401, (headers, method, path, r.text)
                assert r.json() == REFUSED, (headers, method, path)
    finally:
        stack.gateway.config.admin_key = ADMIN
    _assert_untouched(stack, key)


def test_the_tenant_routes_beside_the_admin_api_still_take_a_tenant_key(stack):
    key = stack.tenant("acme")
    with stack.client(key) as c:
        assert c.get("/v1/usage").status_code == 200
        r = c.post("/v1/feedback", json={"request_id": "nope", "outcome": "ok"})
        assert r.status_code == 404  # no cascade here: the route is reached, not refused
    r = httpx.get(f"{stack.url}/v1/usage", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
