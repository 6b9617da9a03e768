"""The /dashboard page's money and routing in a real headless browser (system chromium,
driven by Playwright): spend charts beside the tokens charts, the budget as a row of the limits
card, and the routing card (how `auto` split between pools, escalations, overflow, and what it
cost against all-large and all-small). A gateway from before pricing sends none of these
fields: the page then hides the money charts and the routing card, shows no budget, and still
lays out within its cards.

The JSON is answered by the test (the layout test's FakeApi), as in test_dashboard_layout.py;
the real gateway's answer is test_dashboard_page.py's."""

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.api.dashboard import dashboard_routes
from tests.integration.gateway.test_dashboard_layout import (
    ADMIN_KEY,
    LAYOUT_PROBLEMS,
    ORIGIN,
    POOLS,
    TENANT_KEY,
    FakeApi,
    _serve,
    _sign_in,
)
from tests.integration.gateway.test_dashboard_page import _browser_or_fail


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


class NoSavings(FakeApi):
    """A priced gateway that sends no `savings`: the routing card adds up the rows."""

    def answer(self, path: str, params: dict[str, str], key: str) -> tuple[int, dict]:
        status, doc = super().answer(path, params, key)
        doc.pop("savings", None)
        return status, doc


def _open(browser, pages, api: FakeApi, key: str, width: int = 1400):
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    _serve(page, pages, api)
    page.goto(f"{ORIGIN}/dashboard")
    _sign_in(page, key)
    if key == ADMIN_KEY:
        page.locator("[data-testid=fleet] tr").nth(len(POOLS)).wait_for()
    return page, errors


def _cells(page, testid: str, row_text: str) -> list[str]:
    row = page.locator(f"[data-testid={testid}] tr", has_text=row_text)
    return row.locator("td").all_inner_texts()


@pytest.mark.parametrize("key", [TENANT_KEY, ADMIN_KEY], ids=["tenant", "admin"])
def test_budget_spend_and_routing_read_in_the_currency(browser, pages, key):
    page, errors = _open(browser, pages, FakeApi(), key)
    try:
        # The budget: hard limit, spent, remaining; past its soft limit, so its bar is amber
        # with the soft limit's tick at 80 %.
        budget = _cells(page, "limits", "spend, last 30 days")
        assert budget[1:] == ["$2.5M", "$2.3M", "$154.3K"]
        bar = page.locator("[data-testid=budget] .meter > div")
        assert bar.get_attribute("class") == "warn"
        assert bar.evaluate("b => b.style.width") == "93.8%"
        tick_at = page.locator("[data-testid=budget] .meter").evaluate(
            "m => (m.querySelector('i').getBoundingClientRect().left"
            " - m.getBoundingClientRect().left) / m.clientWidth"
        )
        assert tick_at == pytest.approx(0.8, abs=0.01)
        note = page.get_by_test_id("budget-note").inner_text()
        assert note == "soft limit $2M · spend target $1.8M · resets 01-01 00:00 UTC"

        # Spend per day (split: auto, and a model named) and per model: money on the axis
        # and in the tooltips.
        def legend(chart: str) -> list[str]:
            return page.locator(f"[data-testid={chart}] .legend").evaluate(
                "l => [...l.childNodes].filter((n) => n.nodeType === 3).map((n) => n.data)"
            )

        assert legend("chart-spend-day") == ["model named", "auto"]
        assert legend("chart-spend-model") == ["spend"]
        axis = page.locator("[data-testid=chart-spend-model] svg > text").all_text_contents()
        assert "$0.00" in axis and "$1.2M" in axis
        titles = page.locator("[data-testid=chart-spend-model] rect.bar title")
        assert "small spend: $617.3K" in titles.all_text_contents()
        day_titles = page.locator("[data-testid=chart-spend-day] rect.bar title")
        assert any(t.endswith(" auto: $654.3K") for t in day_titles.all_text_contents())
        # Every day a named model's spend, and auto's on the 11 days that had any.
        assert page.locator("[data-testid=chart-spend-day] rect.bar").count() == 14 + 11

        # Routing: shares of the auto requests per pool, escalations and overflow, and what
        # auto cost against all-large and all-small (from the document's `savings`).
        assert _cells(page, "routing-table", "small") == ["small", "1.6M", "123.5k", "98.8k"]
        assert _cells(page, "routing-table", "total") == ["total", "4.8M", "370.4k", "296.3k"]
        split = page.locator("[data-testid=routing-split] > span")
        assert split.evaluate_all("s => s.map((x) => x.title)") == [
            "meta-llama/Llama-3.1-70B-Instruct-long-context-128k: 42%",
            "small: 33%",
            "qwen2.5-coder-32b-instruct-awq-int4-experimental-build: 25%",
        ]
        legend_text = page.locator("#routing .legend").inner_text()
        assert "small 33%" in legend_text
        cost = page.get_by_test_id("routing-cost")
        assert cost.locator("td.num").all_inner_texts() == ["$1.5M", "$2.9M", "$410K"]
        saved = page.get_by_test_id("routing-saved").inner_text()
        assert saved == "saved $1.5M (50%) against all on the large pool"

        # Each recent request's cost.
        recent = page.get_by_test_id("recent")
        assert recent.locator("th").all_inner_texts()[7] == "cost"
        assert recent.locator("tr").nth(2).locator("td").nth(7).inner_text() == "$6,172.84"
    finally:
        page.close()
    assert not errors, errors


def test_routing_cost_adds_up_the_rows_without_savings(browser, pages):
    page, errors = _open(browser, pages, NoSavings(), TENANT_KEY)
    try:
        cost = page.get_by_test_id("routing-cost").locator("td.num").all_inner_texts()
        # 654,321 x (1 + 1/2 + 1/3) and the like: the three pools that served auto.
        assert cost == ["$1.2M", "$2.4M", "$348.3K"]
    finally:
        page.close()
    assert not errors, errors


@pytest.mark.parametrize("width", [1000, 1920], ids=["1000px", "1920px"])
def test_a_gateway_without_prices_shows_no_money_and_lays_out(browser, pages, width):
    page, errors = _open(browser, pages, FakeApi(money=False), ADMIN_KEY, width)
    try:
        for section in ("spend-day-section", "spend-model-section", "routing-section"):
            assert page.locator(f"#{section}").is_hidden(), section
        assert page.get_by_test_id("budget").count() == 0
        assert page.get_by_test_id("budget-note").is_hidden()
        assert "cost" not in page.get_by_test_id("recent").locator("th").all_inner_texts()
        assert page.locator("[data-testid=chart-day] rect.bar").count() == 28
        assert page.evaluate(LAYOUT_PROBLEMS, True) == []
    finally:
        page.close()
    assert not errors, errors


AMOUNTS = [
    (0, "USD", "$0.00"),
    (0.000412, "USD", "$0.00041"),
    (0.016, "USD", "$0.016"),
    (0.5, "USD", "$0.50"),
    (12.3456, "USD", "$12.35"),
    (9_999.5, "USD", "$9,999.50"),
    (1_234_567.89, "EUR", "€1.2M"),
    (1_500, "JPY", "¥1,500"),
    (3.5, "credits", "3.50 credits"),
    (3.5, None, "3.50"),
    (None, "USD", "\u2014"),
]


def test_amounts_are_short_and_keep_small_digits(browser, pages):
    page, _ = _open(browser, pages, FakeApi(), TENANT_KEY)
    try:
        got = page.evaluate("(cases) => cases.map(([n, c]) => money(n, c))", AMOUNTS)
    finally:
        page.close()
    assert got == [text for _, _, text in AMOUNTS]
