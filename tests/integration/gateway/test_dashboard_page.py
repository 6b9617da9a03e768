"""The built-in /dashboard page in a real headless browser (system chromium, driven by
Playwright): it loads, the charts render from seeded usage, a wrong key is refused, a tenant
sees only its own numbers, and the admin sees every tenant and the fleet; with prices
configured, what the requests cost and how `auto` was routed. A screenshot of each view is kept
in the test's temp dir.

The browser comes from scripts/setup.sh (apt-get install chromium; playwright from the dev
extras). Without it this test fails, unless SWITCHYARD_SKIP_BROWSER=1 says to skip it."""

import os
import shutil
import time

import pytest

from tests.integration.gateway.conftest import ADMIN, gateway_stack

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}


def _browser_or_fail():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium and sync_playwright:
        return chromium, sync_playwright
    why = "no chromium on PATH" if not chromium else "playwright is not installed"
    if os.environ.get("SWITCHYARD_SKIP_BROWSER") == "1":
        pytest.skip(f"{why} (SWITCHYARD_SKIP_BROWSER=1)")
    pytest.fail(f"{why}: run scripts/setup.sh (or SWITCHYARD_SKIP_BROWSER=1 to skip)")


def _seed(stack) -> tuple[str, str]:
    acme = stack.tenant("acme", tokens_per_minute=100_000, max_concurrent=8)
    globex = stack.tenant("globex")
    with stack.client(acme) as c:
        for model in ("small", "small", "large"):
            assert c.post("/v1/completions", json={**BODY, "model": model}).status_code == 200
    with stack.client(globex) as c:
        assert c.post("/v1/completions", json={**BODY, "max_tokens": 9}).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len(stack.usage(acme)["recent"]) == 3 and len(stack.usage(globex)["recent"]) == 1:
            return acme, globex
        time.sleep(0.02)
    raise AssertionError("usage not recorded in time")


def _sign_in(page, url: str, key: str) -> None:
    page.goto(f"{url}/dashboard")
    page.get_by_test_id("key-input").fill(key)
    page.get_by_test_id("signin-button").click()


def test_dashboard_page_in_a_headless_browser(stack, tmp_path):
    chromium, sync_playwright = _browser_or_fail()
    from playwright.sync_api import expect

    acme, globex = _seed(stack)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))

            # Waits are locator assertions: a string predicate (wait_for_function) is
            # evaluated with eval, which the page's CSP (script-src 'self') may refuse.
            _sign_in(page, stack.url, "sy-wrong-key")
            expect(page.locator("#signin-error")).to_contain_text("refused")
            assert page.locator("#app").is_hidden()

            _sign_in(page, stack.url, acme)
            page.wait_for_selector("body[data-loaded]")
            assert page.get_by_test_id("who").inner_text() == "tenant acme"
            day_bars = page.locator("[data-testid=chart-day] rect.bar")
            assert day_bars.count() == 2  # today's prompt and completion
            model_chart = page.get_by_test_id("chart-model").inner_text()
            assert "small" in model_chart and "large" in model_chart
            recent = page.locator("[data-testid=recent] tr")
            assert recent.count() == 1 + 3
            limits = page.get_by_test_id("limits").inner_text()
            assert "100.0k" in limits and "unlimited" in limits
            text = page.content()
            assert "globex" not in text and globex not in text
            assert page.evaluate("sessionStorage.getItem('switchyard.key')") == acme
            assert page.evaluate("localStorage.length") == 0
            assert all(acme not in u for u in requests)  # never in a URL
            assert all(u.startswith(stack.url) for u in requests)  # nothing from elsewhere
            page.screenshot(path=str(tmp_path / "dashboard-tenant.png"), full_page=True)

            page.get_by_role("button", name="Sign out").click()
            assert page.evaluate("sessionStorage.getItem('switchyard.key')") is None
            _sign_in(page, stack.url, ADMIN)
            page.wait_for_selector("body[data-loaded]")
            options = page.locator("[data-testid=tenant-select] option").all_inner_texts()
            assert options == ["acme", "globex"]
            expect(page.locator("[data-testid=fleet] tr")).to_have_count(3)
            fleet = page.get_by_test_id("fleet").inner_text()
            assert "small" in fleet and "large" in fleet and "1 / 1" in fleet
            page.evaluate("document.body.removeAttribute('data-loaded')")
            page.get_by_test_id("tenant-select").select_option("globex")
            page.wait_for_selector("body[data-loaded]")
            expect(page.locator("[data-testid=recent] tr")).to_have_count(2)
            page.screenshot(path=str(tmp_path / "dashboard-admin.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    print(f"screenshots: {tmp_path}/dashboard-tenant.png, dashboard-admin.png")


PRICES = {
    "small": {"prompt_per_mtok": 1_000.0, "completion_per_mtok": 2_000.0},
    "large": {"prompt_per_mtok": 10_000.0, "completion_per_mtok": 20_000.0},
}
CASCADE = {"cascade_small_pool": "small", "cascade_large_pool": "large"}
BUDGET = {"period": "day", "hard": 1.0, "soft": 0.5}


def test_dashboard_shows_what_requests_cost(redis_url, tmp_path):
    """Cost per recent request, the budget row, spend charts and the routing card, from a
    real gateway with prices (issue 37's usage fields)."""
    chromium, sync_playwright = _browser_or_fail()
    with gateway_stack(redis_url, prices=PRICES, **CASCADE) as stack:
        acme = stack.tenant("acme")
        with stack.admin() as admin:
            r = admin.patch("/admin/tenants/acme", json={"budget": BUDGET})
        assert r.status_code == 200, r.text
        with stack.client(acme) as c:
            for model in ("small", "large", "auto"):
                assert c.post("/v1/completions", json={**BODY, "model": model}).status_code == 200
        deadline = time.monotonic() + 10
        while len(stack.usage(acme)["recent"]) < 3:
            assert time.monotonic() < deadline, "usage not recorded in time"
            time.sleep(0.02)
        doc = stack.usage(acme)
        assert doc["currency"] == "USD"
        lines = doc["recent"]
        assert all(line["cost"] > 0 for line in lines), lines

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                _sign_in(page, stack.url, acme)
                page.wait_for_selector("body[data-loaded]")

                # Each recent request's cost, as the gateway charged it, in its currency.
                recent = page.get_by_test_id("recent")
                assert "cost" in recent.locator("th").all_inner_texts()
                column = recent.locator("th").all_inner_texts().index("cost")
                shown = [
                    row.locator("td").nth(column).inner_text()
                    for row in recent.locator("tr").all()[1:]
                ]
                wanted = page.evaluate(
                    "(costs) => costs.map((c) => money(c, 'USD'))", [x["cost"] for x in lines]
                )
                assert shown == wanted and all(c.startswith("$") for c in shown), shown

                # The day's budget: $1.00, what the three requests spent, what remains.
                b = doc["budget"]
                assert (b["hard"], b["soft"]) == (1.0, 0.5) and 0 < b["spent"] < 0.5, b
                cells = page.locator("[data-testid=limits] tr", has_text="spend today")
                wanted = page.evaluate(
                    "(b) => [b.hard, b.spent, b.remaining].map((x) => money(x, 'USD'))", b
                )
                assert cells.locator("td").all_inner_texts()[1:] == wanted
                assert wanted[0] == "$1.00"
                assert "soft limit $0.50" in page.get_by_test_id("budget-note").inner_text()

                # Today's spend (its axis up to the day's cents, not to 1), and spend per
                # model: the pools that served.
                assert page.locator("[data-testid=chart-spend-day] rect.bar").count() >= 1
                axis = page.locator("[data-testid=chart-spend-day] svg > text")
                top = page.evaluate("(c) => money(c, 'USD')", max(r["cost"] for r in doc["data"]))
                assert axis.nth(4).text_content() == top, top
                model_chart = page.get_by_test_id("chart-spend-model").inner_text()
                assert "small" in model_chart and "large" in model_chart

                # The one auto request, on one pool, and what it cost three ways.
                assert page.locator("#routing-section").is_visible()
                total = page.locator("[data-testid=routing-table] tr", has_text="total")
                assert total.locator("td").all_inner_texts()[1] == "1"
                cost = page.get_by_test_id("routing-cost").locator("td.num").all_inner_texts()
                assert len(cost) == 3 and all(c.startswith("$") for c in cost), cost
                page.screenshot(path=str(tmp_path / "dashboard-money.png"), full_page=True)
                assert not errors, errors
            finally:
                browser.close()
    print(f"screenshot: {tmp_path}/dashboard-money.png")
