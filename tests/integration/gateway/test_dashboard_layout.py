"""The /dashboard page's layout in a real headless browser (system chromium, driven by
Playwright), at the widths people use (a phone to a wide desktop), with data that pushes it:
64-character tenant ids, long pool and model names, many replicas, billions of tokens and
limits near and past 100 %, millions in money and a budget past its soft limit. At each
width, in the sign-in view, the tenant view and the admin view: every element of a card lies
within its card, and nothing is wider than its box (the page never scrolls sideways) except
the tables' own scroll containers (`.scroll`), which only scroll on a narrow screen.

The page is served by the gateway's own route handlers (with their CSP); the JSON it asks for
is answered by the test, so no Redis or worker is needed. The browser comes from
scripts/setup.sh; without it this test fails unless SWITCHYARD_SKIP_BROWSER=1 says to skip."""

import json
import time
from urllib.parse import parse_qsl, urlsplit

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.api.dashboard import dashboard_routes
from tests.integration.gateway.test_dashboard_page import _browser_or_fail

ORIGIN = "http://dashboard.test"
ADMIN_KEY = "admin-key"
TENANT_KEY = "sy-0a1b2c3d-secret"
WIDTHS = (360, 768, 1000, 1024, 1280, 1400, 1920)  # 1280: three columns at their narrowest
# From this width up the tables fit their cards: no scroll container may scroll.
FITS_FROM_PX = 1000
DAY_S = 86400

TENANTS = (
    "acme-research-europe-west-batch-inference-team-2024-q3-prod.lab1",  # 64, the longest id
    "globex",
    "initech_customer_support_assistant_staging",
)
MODELS = (
    "meta-llama/Llama-3.1-70B-Instruct-long-context-128k",
    "small",
    "qwen2.5-coder-32b-instruct-awq-int4-experimental-build",
    "mistral-large-2411",
)
POOLS = {
    "large-reasoning-pool-h200-europe-west4-b-dedicated-tenants": 48,
    "small": 3,
    "medium-chat-a100-80gb-us-central1": 12,
}


def _limits_doc(tenant: str) -> dict:
    # Past the day's limit, near the minute's, concurrency exactly full, context unmetered.
    return {
        "tenant_id": tenant,
        "tokens_this_minute": 9_870_000,
        "tokens_today": 5_400_000_000,
        "requests_this_minute": 118_000,
        "concurrent_requests": 512,
        "limits": {
            "tokens_per_minute": 10_000_000,
            "tokens_per_day": 5_000_000_000,
            "requests_per_minute": 120_000,
            "max_concurrent": 512,
            "max_context": 131_072,
        },
    }


CURRENCY = "USD"
# A rolling 30-day budget past its soft limit, near its hard one.
BUDGET = {
    "period": "rolling",
    "window_days": 30,
    "hard": 2_500_000.0,
    "soft": 2_000_000.0,
    "spend_target": 1_800_000.0,
    "spent": 2_345_678.9,
    "remaining": 154_321.1,
    "resets_at": 1_767_225_600,  # 2026-01-01 00:00 UTC
}
SAVINGS = {
    "auto_requests": 3_100_000,
    "spent": 1_450_000.0,
    "all_large": 2_900_000.0,
    "all_small": 410_000.0,
    "share": {MODELS[0]: 0.4, MODELS[1]: 0.6},
}


def _money(k: int) -> dict:
    """A row's money fields (the pricing contract of `/v1/usage`), in millions."""
    auto = (2_000_000 - 400_000 * k) if k < 3 else 0
    return {
        "cost": 1_234_567.89 / (k + 1),
        "auto_requests": auto,
        "auto_cost": 654_321.0 / (k + 1) if auto else 0.0,
        "auto_cost_if_all_large": 1_300_000.0 / (k + 1) if auto else 0.0,
        "auto_cost_if_all_small": 190_000.0 / (k + 1) if auto else 0.0,
        "auto_escalated": 123_456 if auto else 0,
        "auto_overflowed": 98_765 if auto else 0,
    }


def _usage_rows(
    tenant: str, now_s: float, money: bool = True
) -> tuple[list[dict], list[dict], list[dict]]:
    today = int(now_s // DAY_S) * DAY_S
    days = [
        {
            "tenant_id": tenant,
            "day": today - i * DAY_S,
            "prompt_tokens": 3_100_000_000 + i * 97_000_000,
            "completion_tokens": 2_300_000_000 - i * 51_000_000,
            "requests": 4_100_000,
            **(_money(i % 4) if money else {}),
        }
        for i in range(14)
    ]
    models = [
        {
            "tenant_id": tenant,
            "model": m,
            "prompt_tokens": 9_000_000_000 // (k + 1),
            "completion_tokens": 4_000_000_000 // (k + 1),
            "requests": 1_000_000,
            **(_money(k) if money else {}),
        }
        for k, m in enumerate(MODELS)
    ]
    recent = [
        {
            "time": now_s - 7 * i,
            "model": MODELS[i % len(MODELS)],
            "route": "cascade:small->large-reasoning-pool-h200-europe-west4-b",
            "status": (200, 429, 503)[i % 3],
            "prompt_tokens": 126_543 + i,
            "cached_tokens": 98_304,
            "completion_tokens": 32_768,
            "latency_ms": 184_321,
            "key_id": "0a1b2c3d",
            **({"cost": 12_345.678 / (i + 1)} if money else {}),
        }
        for i in range(20)
    ]
    return days, models, recent


def _fleet_doc() -> dict:
    return {
        name: {
            "waiting": 12_345,
            "ttft_p50_s": 1.234,
            "ttft_p99_s": 98.765,
            "tokens_per_s": 1_234_567.89,
            "ready_replicas": n - 1,
            "workers": [{"url": f"http://10.0.{k}.1:8001", "state": "ready"} for k in range(n)],
        }
        for name, n in POOLS.items()
    }


class FakeApi:
    """Answers the page's JSON requests like the gateway would, for ADMIN_KEY and TENANT_KEY.
    `money=False`: like a gateway from before pricing (no currency, cost, budget or savings)."""

    def __init__(self, money: bool = True) -> None:
        self.now_s = time.time()
        self.money = money

    def answer(self, path: str, params: dict[str, str], key: str) -> tuple[int, dict]:
        days, models, recent = _usage_rows(TENANTS[0], self.now_s, self.money)
        rows = models if params.get("group_by") == "model" else days
        priced = {"currency": CURRENCY, "savings": SAVINGS} if self.money else {}
        budget = {"budget": BUDGET} if self.money else {}
        if path == "/v1/usage":
            if key != TENANT_KEY:
                return 401, {"error": {"message": "invalid key"}}
            limits = _limits_doc(TENANTS[0])
            return 200, {**limits, **priced, **budget, "data": rows, "recent": recent}
        if key != ADMIN_KEY:
            return 401, {"error": {"message": "invalid key"}}
        if path == "/admin/fleet":
            return 200, _fleet_doc()
        if path == "/admin/usage":
            wanted = [params["tenant"]] if "tenant" in params else list(TENANTS)
            current = {t: {**_limits_doc(t), **budget} for t in wanted}
            doc = {**priced, "data": rows, "current": current}
            if params.get("recent"):
                doc["recent"] = {t: recent for t in wanted}
            return 200, doc
        return 404, {"error": {"message": "not found"}}


@pytest.fixture(scope="module")
def browser():
    chromium, sync_playwright = _browser_or_fail()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def pages():
    with TestClient(Litestar(route_handlers=dashboard_routes())) as client:
        yield client


def _serve(page, pages: TestClient, api: FakeApi) -> None:
    def handle(route) -> None:
        url = urlsplit(route.request.url)
        if url.path.startswith("/dashboard"):
            r = pages.get(url.path)
            route.fulfill(status=r.status_code, headers=dict(r.headers), body=r.content)
            return
        key = (route.request.headers.get("authorization") or "").removeprefix("Bearer ")
        status, doc = api.answer(url.path, dict(parse_qsl(url.query)), key)
        route.fulfill(status=status, content_type="application/json", body=json.dumps(doc))

    page.route(f"{ORIGIN}/**", handle)


# Every problem on the page, as one line each: a card's descendant outside the card, an
# element wider than its box (not a `.scroll` container), a scroll container that scrolls when
# `fits` says everything should fit, the page wider than the window, chart labels cut off by
# their chart or overlapping each other.
LAYOUT_PROBLEMS = r"""(fits) => {
  const out = [];
  const docEl = document.documentElement;
  const shown = (e) => e.getClientRects().length > 0;
  const name = (e) => {
    const cls = typeof e.className === "string" && e.className ? "." + e.className.trim()
      .split(/\s+/).join(".") : "";
    const text = (e.textContent || "").replace(/\s+/g, " ").trim().slice(0, 40);
    return `<${e.tagName.toLowerCase()}${e.id ? "#" + e.id : ""}${cls}> "${text}"`;
  };
  const cardName = (c) => (c.querySelector("h2") || c).textContent.trim().slice(0, 30);
  const px = (v) => v.toFixed(1);
  if (docEl.scrollWidth > docEl.clientWidth) {
    out.push(`the page scrolls sideways: ${docEl.scrollWidth} > ${docEl.clientWidth} px`);
  }
  const isScroller = (e) => e.classList.contains("scroll")
    && ["auto", "scroll"].includes(getComputedStyle(e).overflowX);
  // An element too wide for its box makes each of its ancestors too wide as well: only the
  // innermost is told. A card's descendant outside the card is told at the outermost one.
  const wide = [...document.body.querySelectorAll("*")].filter((e) => shown(e)
    && !(e instanceof SVGElement && !(e instanceof SVGSVGElement))
    && e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1);
  for (const e of wide) {
    if (wide.some((d) => d !== e && e.contains(d))) continue;
    if (!isScroller(e)) {
      out.push(`${name(e)} is wider than its box: ${e.scrollWidth} > ${e.clientWidth} px`);
    } else if (fits) {
      out.push(`${name(e)} scrolls at this width: ${e.scrollWidth} > ${e.clientWidth} px`);
    }
  }
  const told = new Set();
  const toldAbove = (e) => {
    for (let a = e.parentElement; a; a = a.parentElement) if (told.has(a)) return true;
    return false;
  };
  for (const card of document.querySelectorAll("section")) {
    if (!shown(card)) continue;
    const c = card.getBoundingClientRect();
    if (c.left < -0.5 || c.right > docEl.clientWidth + 0.5) {
      out.push(`card "${cardName(card)}" runs outside the window: ${px(c.left)}..${px(c.right)}`);
    }
    for (const e of card.querySelectorAll("*")) {
      if (!shown(e)) continue;
      // Inside a scroll container an element may lie out of view: the container is checked.
      const scroller = e.parentElement && e.parentElement.closest(".scroll");
      if (scroller && card.contains(scroller)) continue;
      const r = e.getBoundingClientRect();
      if (r.width === 0 && r.height === 0 || toldAbove(e)) continue;
      if (r.left < c.left - 0.5 || r.right > c.right + 0.5 || r.top < c.top - 0.5
          || r.bottom > c.bottom + 0.5) {
        told.add(e);
        out.push(`in card "${cardName(card)}" (${px(c.left)}..${px(c.right)}): ${name(e)} at `
                 + `${px(r.left)}..${px(r.right)} x ${px(r.top)}..${px(r.bottom)}`);
      }
    }
  }
  for (const chart of document.querySelectorAll("section svg")) {
    if (!shown(chart)) continue;
    const s = chart.getBoundingClientRect();
    const labels = [...chart.querySelectorAll("text")].map((t) => [t, t.getBoundingClientRect()]);
    for (const [t, r] of labels) {
      if (r.left < s.left - 0.5 || r.right > s.right + 0.5 || r.top < s.top - 0.5
          || r.bottom > s.bottom + 0.5) {
        out.push(`chart label "${t.textContent}" is cut off by its chart: ${px(r.left)}..`
                 + `${px(r.right)} in ${px(s.left)}..${px(s.right)}`);
      }
    }
    labels.forEach(([a, ra], i) => labels.slice(i + 1).forEach(([b, rb]) => {
      if (ra.left < rb.right - 0.5 && rb.left < ra.right - 0.5 && ra.top < rb.bottom - 0.5
          && rb.top < ra.bottom - 0.5) {
        out.push(`chart labels overlap: "${a.textContent}" and "${b.textContent}"`);
      }
    }));
  }
  return out;
}"""


def _sign_in(page, key: str) -> None:
    page.evaluate("document.body.removeAttribute('data-loaded')")
    page.get_by_test_id("key-input").fill(key)
    page.get_by_test_id("signin-button").click()
    page.wait_for_selector("body[data-loaded]")


@pytest.mark.parametrize("width", WIDTHS, ids=[f"{w}px" for w in WIDTHS])
def test_no_card_content_overflows_its_card(browser, pages, width, tmp_path):
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    _serve(page, pages, FakeApi())
    fits = width >= FITS_FROM_PX
    problems: list[str] = []
    shot = tmp_path / f"dashboard-admin-{width}.png"
    try:
        page.goto(f"{ORIGIN}/dashboard")
        problems += [f"sign-in: {p}" for p in page.evaluate(LAYOUT_PROBLEMS, fits)]

        _sign_in(page, TENANT_KEY)
        assert page.get_by_test_id("who").inner_text() == f"tenant {TENANTS[0]}"
        problems += [f"tenant: {p}" for p in page.evaluate(LAYOUT_PROBLEMS, fits)]

        page.get_by_role("button", name="Sign out").click()
        _sign_in(page, ADMIN_KEY)
        page.locator("[data-testid=fleet] tr").nth(len(POOLS)).wait_for()
        assert page.locator("[data-testid=recent] tr").count() == 1 + 20
        problems += [f"admin: {p}" for p in page.evaluate(LAYOUT_PROBLEMS, fits)]
        page.screenshot(path=str(shot), full_page=True)
    finally:
        page.close()
    assert not errors, errors
    assert not problems, f"at {width} px (screenshot {shot}):\n" + "\n".join(problems)


def test_big_numbers_and_long_names_are_shortened_not_dropped(browser, pages):
    # What keeps the cards narrow must not lose what they say: billions read as G, a limit
    # overshot as a negative remainder, long chart labels cut with the whole name kept.
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    _serve(page, pages, FakeApi())
    try:
        page.goto(f"{ORIGIN}/dashboard")
        _sign_in(page, ADMIN_KEY)
        page.locator("[data-testid=fleet] tr").nth(len(POOLS)).wait_for()
        day_row = page.locator("[data-testid=limits] tr", has_text="tokens per day")
        assert day_row.locator("td").all_inner_texts()[1:] == ["5.0G", "5.4G", "-400.0M"]
        big_pool = page.locator("[data-testid=fleet] tr", has_text="large-reasoning-pool")
        cells = big_pool.locator("td").all_inner_texts()
        assert cells == [next(iter(POOLS)), "12.3k", "1.23 s", "98.8 s", "1.2M", "47 / 48"]
        labels = page.locator("[data-testid=chart-model] svg > text")
        cut = [t for t in labels.all() if t.evaluate("t => t.firstChild.data").endswith("\u2026")]
        assert cut, "no label was shortened"
        assert {t.locator("title").text_content() for t in cut} <= set(MODELS)
        assert page.get_by_test_id("tenant-select").input_value() == TENANTS[0]
    finally:
        page.close()
