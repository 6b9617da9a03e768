"""Usage history over real HTTP: every settled request is recorded by tenant, model, key, day
and hour; a tenant sees only its own; the admin sees all, as JSON or CSV; metrics carry
tenants (bounded) and tokens, never keys."""

import csv
import io
import time

import httpx

from tests.integration.gateway.conftest import gateway_stack

MONTH_AGO = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 30 * 86400))
BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}  # charged 4 + 6


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def recent(stack, key: str, n: int) -> list[dict]:
    with stack.client(key) as c:
        lines = c.get("/v1/usage", params={"recent": 50}).json()["recent"]
    return lines if len(lines) >= n else []


def test_usage_by_model_key_day_and_recent_requests_of_the_calling_tenant_only(stack):
    key_a = stack.tenant("acme")
    with stack.admin() as admin:
        key_a2 = admin.post("/admin/tenants/acme/keys", json={"name": "ci"}).json()["key"]
    key_b = stack.tenant("globex")
    with stack.client(key_a) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        assert c.post("/v1/completions", json={**BODY, "model": "large"}).status_code == 200
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
    with stack.client(key_a2) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
    with stack.client(key_b) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
    lines = wait_for(lambda: recent(stack, key_a, 4))
    assert {ln["status"] for ln in lines} == {200} and len(lines) == 4
    assert {ln["model"] for ln in lines} == {"small", "large"}
    assert all(ln["prompt_tokens"] == 4 and ln["completion_tokens"] == 6 for ln in lines)
    assert "key" not in lines[0] and lines[0]["key_id"] != "-"

    with stack.client(key_a) as c:
        doc = c.get("/v1/usage", params={"group_by": "model"}).json()
        assert doc["tenant_id"] == "acme" and doc["granularity"] == "hour"
        assert "tokens_this_minute" in doc and "concurrent_requests" in doc  # current windows
        models = {r["model"]: r for r in doc["data"]}
        assert models["small"]["requests"] == 3 and models["small"]["total_tokens"] == 30
        assert models["large"]["requests"] == 1
        assert {r["tenant_id"] for r in doc["data"]} == {"acme"}
        keys = c.get("/v1/usage", params={"group_by": "key"}).json()["data"]
        assert sorted(r["requests"] for r in keys) == [1, 3]
        days = c.get("/v1/usage", params={"group_by": "day", "start": MONTH_AGO}).json()
        assert days["granularity"] == "day" and sum(r["requests"] for r in days["data"]) == 4
        hours = c.get("/v1/usage", params={"group_by": "hour"}).json()["data"]
        assert sum(r["requests"] for r in hours) == 4 and all(r["hour"] % 3600 == 0 for r in hours)
        for bad in (
            {"group_by": "tenant"},
            {"start": "yesterday"},
            {"start": "5", "end": "1"},
            {"start": "2020-01-01"},  # more than 400 days
        ):
            r = c.get("/v1/usage", params=bad)
            assert r.status_code == 400, (bad, r.text)
    with stack.client(key_b) as c:
        doc = c.get("/v1/usage", params={"group_by": "model"}).json()
        assert doc["tenant_id"] == "globex" and [r["requests"] for r in doc["data"]] == [1]
        assert [ln["request_id"] for ln in doc["recent"]] != [ln["request_id"] for ln in lines]

    with stack.admin() as admin:
        doc = admin.get("/admin/usage", params={"group_by": "model"}).json()
        assert {(r["tenant_id"], r["model"]) for r in doc["data"]} == {
            ("acme", "small"),
            ("acme", "large"),
            ("globex", "small"),
        }
        assert set(doc["current"]) == {"acme", "globex"}
        text = admin.get("/admin/usage", params={"group_by": "day", "format": "csv"}).text
        rows = list(csv.DictReader(io.StringIO(text)))
        assert {r["tenant_id"] for r in rows} == {"acme", "globex"}
        assert sum(int(r["total_tokens"]) for r in rows) == 50
        only = admin.get("/admin/usage", params={"tenant": "globex"}).json()["data"]
        assert {r["tenant_id"] for r in only} == {"globex"}
    assert (
        httpx.get(f"{stack.url}/admin/usage", headers={"authorization": "Bearer x"}).status_code
        == 401
    )
    r = httpx.get(f"{stack.url}/v1/usage", headers={"authorization": "Bearer sy-bad-key"})
    assert r.status_code == 401


def test_a_client_that_leaves_and_a_quota_refusal_show_in_usage_and_metrics(redis_url):
    with gateway_stack(redis_url, metrics_tenant_cap=1) as s:
        key = s.tenant("acme", tokens_per_minute=25)
        other = s.tenant("initech")
        with s.client(key) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
            assert c.post("/v1/completions", json=BODY).status_code == 200
            assert c.post("/v1/completions", json=BODY).status_code == 429
        with s.client(other) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
        wait_for(lambda: recent(s, other, 1))
        text = httpx.get(f"{s.url}/metrics").text
        reg = s.gateway.registry
        tokens = reg.get_sample_value(
            "switchyard_gateway_tokens_total",
            {"tenant": "acme", "model": "small", "kind": "completion"},
        )
        assert tokens == 12
        other_tokens = reg.get_sample_value(
            "switchyard_gateway_tokens_total",
            {"tenant": "other", "model": "small", "kind": "prompt"},
        )
        assert other_tokens == 4  # past the cap of 1 named tenant
        assert (
            reg.get_sample_value(
                "switchyard_gateway_quota_refusals_total",
                {"tenant": "acme", "limit": "tokens_per_minute"},
            )
            == 1
        )
        assert 'switchyard_gateway_queue_depth{pool="small"}' in text
        assert key.split("-")[1] not in text and key not in text


def test_a_stream_cut_by_the_worker_and_a_client_that_leaves_are_recorded(stack):
    key = stack.tenant("cuts")
    stack.backends["small0"].mode = "die_mid_stream"
    with stack.client(key) as c:
        body = {**BODY, "max_tokens": 10, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
    [cut] = wait_for(lambda: recent(stack, key, 1))
    assert cut["status"] == 502 and (cut["prompt_tokens"], cut["completion_tokens"]) == (4, 5)

    stack.backends["small0"].mode = "ok"
    stack.backends["small0"].token_delay_s = 0.05
    with stack.client(key) as c:
        body = {**BODY, "max_tokens": 50, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the client leaves after the first token
    lines = wait_for(lambda: recent(stack, key, 2))
    gone = lines[0]
    assert gone["status"] == 499 and 1 <= gone["completion_tokens"] < 50
    with stack.client(key) as c:
        [row] = c.get("/v1/usage", params={"group_by": "model"}).json()["data"]
    assert row["requests"] == 2 and row["errors"] == 2


def test_csv_cells_a_spreadsheet_would_run_as_formulas_are_quoted(redis_url):
    """`-2-3` is a valid tenant id and -5 in a spreadsheet; a model (pool) name or a key's
    column can start with `-`, `+`, `@`, `=`, tab or CR as well: every such cell gets a `'`."""
    pools = {"-1+1": 1, "@sum": 1}
    with gateway_stack(redis_url, replicas=pools) as s:
        key = s.tenant("-2-3")
        with s.client(key) as c:
            for model in pools:
                assert c.post("/v1/completions", json={**BODY, "model": model}).status_code == 200
        wait_for(lambda: recent(s, key, 2))
        seen: set[str] = set()
        with s.admin() as admin:
            for group_by in ("day", "model", "key", "hour"):
                r = admin.get("/admin/usage", params={"group_by": group_by, "format": "csv"})
                assert r.status_code == 200, r.text
                rows = list(csv.reader(io.StringIO(r.text)))[1:]
                assert rows, group_by
                for row in rows:
                    for cell in row:
                        assert not cell.startswith(("-", "=", "+", "@", "\t", "\r")), row
                    seen.update(row[:2])
    assert {"'-2-3", "'-1+1", "'@sum"} <= seen, seen
