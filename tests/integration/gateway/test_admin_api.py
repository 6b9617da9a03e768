"""The admin API's update semantics over real HTTP: PATCH merges (a field left out is left
alone, null clears it), PUT replaces the whole document, types are strict, allowed_models
names existing pools; keys list their last use."""

import time

from tests.integration.gateway.conftest import gateway_stack

CASCADE = {"cascade_small_pool": "small", "cascade_large_pool": "large"}


def test_patch_tenant_merges_limits_and_put_replaces_the_document(stack):
    with stack.admin() as c:
        limits = {"tokens_per_minute": 1000, "tokens_per_day": 50_000, "max_concurrent": 4}
        r = c.post("/admin/tenants", json={"tenant_id": "acme", "limits": limits})
        assert r.status_code == 201, r.text
        r = c.patch("/admin/tenants/acme", json={"limits": {"tokens_per_minute": 2000}})
        assert r.status_code == 200, r.text
        assert r.json()["limits"] == {**limits, "tokens_per_minute": 2000, **_unset()}
        r = c.patch("/admin/tenants/acme", json={"limits": {"max_concurrent": None}})
        assert r.json()["limits"]["max_concurrent"] is None
        assert r.json()["limits"]["tokens_per_day"] == 50_000
        r = c.patch("/admin/tenants/acme", json={"allowed_models": ["large"], "name": "Acme"})
        assert r.json()["allowed_models"] == ["large"] and r.json()["limits"]["tokens_per_day"]
        r = c.patch("/admin/tenants/acme", json={"allowed_models": None})
        assert r.json()["allowed_models"] == [] and r.json()["name"] == "Acme"
        r = c.put("/admin/tenants/acme", json={"limits": {"tokens_per_day": 10}})
        assert r.status_code == 200
        doc = r.json()
        assert doc["limits"]["tokens_per_day"] == 10 and doc["limits"]["tokens_per_minute"] is None
        assert doc["name"] == "acme" and doc["allow_overflow"] is True


def _unset() -> dict:
    return {"requests_per_minute": None, "max_context": None}


def test_admin_types_are_strict_and_pools_must_exist(stack):
    with stack.admin() as c:
        assert c.post("/admin/tenants", json={"tenant_id": "acme"}).status_code == 201
        bad = [
            {"allow_overflow": "false"},
            {"limits": {"tokens_per_minute": "100"}},
            {"limits": {"tokens_per_minute": True}},
            {"limits": {"tokens_per_minute": -1}},
            {"limits": {"tokens_per_hour": 5}},
            {"allowed_models": ["medium"]},
            {"allowed_models": "small"},
            {"name": 5},
            {"colour": "red"},
        ]
        for body in bad:
            r = c.patch("/admin/tenants/acme", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"], body
        r = c.post("/admin/tenants", json={"tenant_id": "b", "allowed_models": ["gpt-9"]})
        assert r.status_code == 400 and "gpt-9" in r.json()["error"]["message"]
        assert c.get("/admin/tenants/acme").json()["allow_overflow"] is True
        assert c.patch("/admin/tenants/nobody", json={"name": "x"}).status_code == 404


def test_keys_list_their_prefix_and_last_use(stack):
    key = stack.tenant("acme")
    with stack.admin() as c:
        [listed] = c.get("/admin/tenants/acme/keys").json()["data"]
        assert listed["last_used_at"] is None and key.startswith(listed["prefix"])
    before = time.time()
    with stack.client(key) as c:
        body = {"model": "small", "prompt": [1, 2], "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 10
    with stack.admin() as c:
        while True:
            [listed] = c.get("/admin/tenants/acme/keys").json()["data"]
            if listed["last_used_at"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert listed["last_used_at"] >= before - 1


def test_patch_routing_changes_one_field_and_put_replaces(redis_url):
    with gateway_stack(redis_url, **CASCADE) as s, s.admin() as c:
        assert c.post("/admin/tenants", json={"tenant_id": "acme"}).status_code == 201
        r = c.put(
            "/admin/routing",
            json={"tenant_thresholds": {"acme": 0.2}, "overflow_max_wait_s": 9.0},
        )
        assert r.status_code == 200, r.text
        r = c.patch("/admin/routing", json={"overflow_max_wait_s": 3.0})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["overflow_max_wait_s"] == 3.0 and doc["tenant_thresholds"] == {"acme": 0.2}
        r = c.patch("/admin/routing", json={"escalation": {"*": {"enabled": True}}})
        assert r.json()["escalation"]["*"]["enabled"] is True
        r = c.patch("/admin/routing", json={"escalation": {"*": {"min_mean_logprob": -2.0}}})
        esc = r.json()["escalation"]["*"]
        assert esc["enabled"] is True and esc["min_mean_logprob"] == -2.0
        r = c.patch("/admin/routing", json={"tenant_thresholds": {"acme": None}})
        assert r.json()["tenant_thresholds"] == {} and r.json()["overflow_max_wait_s"] == 3.0
        for bad in ({"overflow_max_wait_s": "3"}, {"escalation": {"*": {"enabled": "false"}}}):
            assert c.patch("/admin/routing", json=bad).status_code == 400, bad
        r = c.put("/admin/routing", json={"overflow_max_wait_s": 1.0})
        assert r.json()["escalation"] == {} and r.json()["overflow_max_wait_s"] == 1.0
        audit = c.get("/admin/routing/audit").json()["data"]
        assert len(audit) == 6


def test_the_openapi_schema_lists_the_admin_api(stack):
    with stack.admin() as c:
        doc = c.get("/schema/openapi.json").json()
    assert doc["info"]["title"] == "Switchyard gateway"
    paths = doc["paths"]
    assert {"get", "put", "patch", "delete"} <= set(paths["/admin/tenants/{tenant_id}"])
    assert {"get", "put", "patch"} <= set(paths["/admin/routing"])
    for path in ("/admin/usage", "/admin/fleet", "/admin/tenants/{tenant_id}/keys", "/v1/usage"):
        assert "get" in paths[path], path


def test_a_constraint_violation_is_a_400_naming_the_field_in_param(stack):
    key = stack.tenant("acme")
    cases = [
        ("POST", "/admin/tenants", {"name": "no id"}, "tenant_id"),
        ("POST", "/admin/tenants", {"tenant_id": 5}, "tenant_id"),
        ("POST", "/admin/tenants", {"tenant_id": "b", "name": ""}, "name"),
        ("PATCH", "/admin/tenants/acme", {"name": "n" * 201}, "name"),
        ("PATCH", "/admin/tenants/acme", {"limits": {"max_context": 0}}, "limits.max_context"),
        ("PUT", "/admin/tenants/acme", {"limits": {"tokens_per_day": -5}}, "limits.tokens_per_day"),
        (
            "PATCH",
            "/admin/tenants/acme",
            {"limits": {"tokens_per_hour": 5}},
            "limits.tokens_per_hour",
        ),
        ("PUT", "/admin/tenants/acme", {"colour": "red"}, "colour"),
        (
            "POST",
            "/admin/tenants/acme/keys",
            {"limits": {"max_concurrent": 0}},
            "limits.max_concurrent",
        ),
        ("POST", "/admin/tenants/acme/keys", {"expires_at": "soon"}, "expires_at"),
        ("POST", "/admin/tenants/acme/keys", {"name": 7}, "name"),
        ("POST", "/admin/tenants/acme/keys", {"scope": "all"}, "scope"),
    ]
    with stack.admin() as c:
        for method, path, body, param in cases:
            r = c.request(method, path, json=body)
            assert r.status_code == 400, (method, path, body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error" and error["message"], body
        tenant = c.get("/admin/tenants/acme").json()
        assert tenant["name"] == "acme" and tenant["limits"]["max_context"] is None
        assert [t["tenant_id"] for t in c.get("/admin/tenants").json()["data"]] == ["acme"]
        assert len(c.get("/admin/tenants/acme/keys").json()["data"]) == 1
        for raw in (b"[1, 2]", b"{not json", b'"acme"'):
            r = c.patch("/admin/tenants/acme", content=raw)
            assert r.status_code == 400 and set(r.json()) == {"error"}, raw
    with stack.client(key) as c:
        r = c.post("/v1/feedback", json={"request_id": "r", "outcome": "meh"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "outcome"
    with stack.admin() as c:
        r = c.put("/admin/routing/classifiers/acme", json={"version": "1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "version"
        r = c.put("/admin/routing/classifiers/acme", json={"files": {"model.json": 5}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "files"
