"""A key's own limits: counted over that key's requests only, on top of its tenant's (a
request must fit both); a refusal by either leaves nothing reserved. Set through the admin
API and `switchyard admin key create --tokens-per-minute ...`."""

import json

from cli.main import main as cli_main
from tests.support.waiting import eventually

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}  # costs 4 + 6 = 10


def key_with(stack, tenant_id: str, **limits) -> str:
    with stack.admin() as a:
        r = a.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k", "limits": limits})
        assert r.status_code == 201, r.text
        assert r.json()["limits"]["tokens_per_minute"] == limits.get("tokens_per_minute")
        return r.json()["key"]


def test_a_keys_own_limit_refuses_that_key_only_and_the_tenant_counts_all(stack):
    open_key = stack.tenant("acme", tokens_per_minute=10_000, max_concurrent=8)
    narrow = key_with(stack, "acme", tokens_per_minute=20, max_concurrent=2)
    with stack.client(narrow) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        assert c.post("/v1/completions", json=BODY).status_code == 200
        refused = c.post("/v1/completions", json=BODY)
    assert refused.status_code == 429 and "retry-after" in refused.headers
    with stack.client(open_key) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
    # The tenant's windows count every key's requests, and nothing for the refused one.
    assert eventually(lambda: stack.charged("acme") == 30)
    assert eventually(lambda: stack.usage(open_key)["concurrent_requests"] == 0)
    assert stack.backends["small0"].total == 3


def test_a_keys_context_limit_is_a_400(stack):
    stack.tenant("acme")
    narrow = key_with(stack, "acme", tokens_per_minute=None, max_context=8)
    with stack.client(narrow) as c:
        r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert stack.backends["small0"].total == 0


def test_bad_key_limits_are_400(stack):
    stack.tenant("acme")
    with stack.admin() as a:
        r = a.post("/admin/tenants/acme/keys", json={"limits": {"tokens_per_minute": "9"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limits.tokens_per_minute"
        r = a.post("/admin/tenants/acme/keys", json={"limits": {"per_fortnight": 9}})
        assert r.status_code == 400


def test_the_admin_cli_creates_a_key_with_its_own_limits_and_lists_them(stack, capsys):
    from tests.integration.gateway.conftest import ADMIN

    stack.tenant("acme")
    base = ["admin", "--url", stack.url, "--admin-key", ADMIN, "--json"]
    assert cli_main([*base, "key", "create", "acme", "--tokens-per-minute", "50"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["limits"]["tokens_per_minute"] == 50
    assert cli_main([*base, "key", "list", "acme"]) == 0
    listed = json.loads(capsys.readouterr().out)["data"]
    mine = [k for k in listed if k["key_id"] == created["key_id"]]
    assert mine and mine[0]["limits"]["tokens_per_minute"] == 50
