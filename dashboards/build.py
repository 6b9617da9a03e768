"""Write the Grafana dashboards of this folder (tenant-usage.json, fleet.json).

    python dashboards/build.py

The JSON files are committed; edit the panels here and re-run. Every query sums over
`instance`, so several gateway replicas (each its own scrape target) show as one; a budget
gauge (each replica's view as of its last request for the tenant) takes the most spent one.
Money is in the gateway's `currency` (USD unless configured): set CURRENCY_UNIT to match.
"""

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
CURRENCY_UNIT = "currencyUSD"  # Grafana's unit for the gateway's currency (currencyEUR, ...)


def _panel(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, **kw: Any) -> dict:
    unit = kw.pop("unit", "short")
    kind = kw.pop("kind", "timeseries")
    w, h = kw.pop("w", 12), kw.pop("h", 8)
    defaults = kw.pop("defaults", {})  # more field defaults (thresholds, ...)
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
        "targets": [
            {"refId": chr(65 + i), "expr": expr, "legendFormat": legend, "datasource": DS}
            for i, (expr, legend) in enumerate(targets)
        ],
        **kw,
    }


def _dashboard(uid: str, title: str, panels: list[dict], variables: list[dict]) -> dict:
    datasource = {
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
        "label": "Prometheus",
        "current": {},
    }
    return {
        "uid": uid,
        "title": title,
        "tags": ["switchyard"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [datasource, *variables]},
        "panels": panels,
        "annotations": {"list": []},
    }


# The TenantNearBudget alert's threshold (alerts.yml) as a line on the budget panel.
NEAR_BUDGET = {
    "min": 0,
    "thresholds": {
        "mode": "absolute",
        "steps": [
            {"color": "green", "value": None},
            {"color": "orange", "value": 0.9},
            {"color": "red", "value": 1},
        ],
    },
    "custom": {"thresholdsStyle": {"mode": "line+area"}},
}


def tenant_usage() -> dict:
    t = 'tenant=~"$tenant"'
    tenant_var = {
        "name": "tenant",
        "label": "Tenant",
        "type": "query",
        "datasource": DS,
        "query": {"query": "label_values(switchyard_gateway_tokens_total, tenant)", "refId": "T"},
        "definition": "label_values(switchyard_gateway_tokens_total, tenant)",
        "includeAll": True,
        "multi": True,
        "refresh": 2,
        "current": {},
    }
    tok = "switchyard_gateway_tokens_total"
    spend = "switchyard_gateway_spend_total"
    panels = [
        _panel(1, "Tokens per second by model", [
            (f'sum by (model, kind) (rate({tok}{{{t}, kind!="cached"}}[$__rate_interval]))',
             "{{model}} {{kind}}"),
        ], 0, 0, unit="tok/s"),
        _panel(2, "Tokens per day", [
            (f'sum by (tenant) (increase({tok}{{{t}, kind!="cached"}}[1d]))', "{{tenant}}"),
        ], 12, 0, kind="barchart", interval="1d"),
        _panel(3, "Prefix-cache share of prompt tokens", [
            (f'sum(rate({tok}{{{t}, kind="cached"}}[$__rate_interval])) / '
             f'clamp_min(sum(rate({tok}{{{t}, kind="prompt"}}[$__rate_interval])), 1e-9)',
             "cached / prompt"),
        ], 0, 8, unit="percentunit"),
        _panel(4, "Requests by status", [
            ("sum by (status) (rate(switchyard_gateway_tenant_requests_total"
             f"{{{t}}}[$__rate_interval]))", "{{status}}"),
        ], 12, 8, unit="reqps"),
        _panel(5, "Quota refusals by limit", [
            ("sum by (limit) (rate(switchyard_gateway_quota_refusals_total"
             f"{{{t}}}[$__rate_interval]))", "{{limit}}"),
        ], 0, 16, unit="reqps"),
        _panel(6, "End-to-end latency p50 / p99 by model", [
            ("histogram_quantile(0.5, sum by (pool, le) (rate("
             "switchyard_gateway_e2e_request_latency_seconds_bucket[$__rate_interval])))",
             "p50 {{pool}}"),
            ("histogram_quantile(0.99, sum by (pool, le) (rate("
             "switchyard_gateway_e2e_request_latency_seconds_bucket[$__rate_interval])))",
             "p99 {{pool}}"),
        ], 12, 16, unit="s"),
        _panel(7, "Spend per hour by tenant", [
            (f"sum by (tenant) (rate({spend}{{{t}}}[$__rate_interval])) * 3600", "{{tenant}}"),
        ], 0, 24, unit=CURRENCY_UNIT),
        _panel(8, "Spend per day by tenant and model", [
            (f"sum by (tenant, model) (increase({spend}{{{t}}}[1d]))", "{{tenant}} {{model}}"),
        ], 12, 24, kind="barchart", interval="1d", unit=CURRENCY_UNIT),
        _panel(9, "Budget spent (share of the hard budget, this period)", [
            (f"max by (tenant) (switchyard_gateway_budget_spent_ratio{{{t}}})", "{{tenant}}"),
        ], 0, 32, unit="percentunit", defaults=NEAR_BUDGET),
        _panel(10, "Budget remaining (this period)", [
            (f"min by (tenant) (switchyard_gateway_budget_remaining{{{t}}})", "{{tenant}}"),
        ], 12, 32, unit=CURRENCY_UNIT),
        _panel(11, "Budget refusals", [
            ("sum by (tenant) (rate(switchyard_gateway_budget_refusals_total"
             f"{{{t}}}[$__rate_interval]))", "{{tenant}}"),
        ], 0, 40, unit="reqps"),
        _panel(12, "Soft budget crossings per hour", [
            ("sum by (tenant) (increase(switchyard_gateway_budget_soft_crossings_total"
             f"{{{t}}}[1h]))", "{{tenant}}"),
        ], 12, 40),
    ]  # fmt: skip
    return _dashboard("switchyard-tenant-usage", "Switchyard / tenant usage", panels, [tenant_var])


def fleet() -> dict:
    def q(metric: str, quantile: float) -> str:
        return (
            f"histogram_quantile({quantile}, sum by (pool, le) "
            f"(rate({metric}_bucket[$__rate_interval])))"
        )

    decisions = "rate(switchyard_cascade_decisions_total[$__rate_interval])"
    ttft = "switchyard_gateway_time_to_first_token_seconds"
    itl = "switchyard_gateway_inter_token_latency_seconds"
    panels = [
        _panel(1, "Queue depth per pool (gateway)", [
            ("sum by (pool) (switchyard_gateway_queue_depth)", "{{pool}} gateway"),
            ("sum by (pool) (switchyard_worker_num_requests_waiting)", "{{pool}} workers"),
        ], 0, 0),
        _panel(2, "Replicas per pool", [
            ("sum by (pool, state) (switchyard_gateway_pool_replicas)", "{{pool}} {{state}}"),
        ], 12, 0),
        _panel(3, "TTFT p50 / p99 (client view)", [
            (q(ttft, 0.5), "p50 {{pool}}"), (q(ttft, 0.99), "p99 {{pool}}"),
        ], 0, 8, unit="s"),
        _panel(4, "Inter-token latency p50 / p99 (client view)", [
            (q(itl, 0.5), "p50 {{pool}}"), (q(itl, 0.99), "p99 {{pool}}"),
        ], 12, 8, unit="s"),
        _panel(5, "Output tokens per second", [
            ('sum by (model) (rate(switchyard_gateway_tokens_total{kind="completion"}'
             "[$__rate_interval]))", "{{model}}"),
        ], 0, 16, unit="tok/s"),
        _panel(6, "KV cache usage", [
            ("max by (pool, instance) (switchyard_worker_kv_cache_usage_perc)",
             "{{pool}} {{instance}}"),
        ], 12, 16, unit="percentunit"),
        _panel(7, "Preemptions per second", [
            ("sum by (pool) (rate(switchyard_worker_num_preemptions_total[$__rate_interval]))",
             "{{pool}}"),
        ], 0, 24),
        _panel(8, "Prefix-cache hit rate", [
            ("sum by (pool) (rate(switchyard_worker_prefix_cache_hits_total[$__rate_interval]))"
             " / clamp_min(sum by (pool) (rate(switchyard_worker_prefix_cache_queries_total"
             "[$__rate_interval])), 1e-9)", "{{pool}}"),
        ], 12, 24, unit="percentunit"),
        _panel(9, "Cascade split (auto)", [
            ("sum by (pool, route) (rate(switchyard_cascade_decisions_total[$__rate_interval]))",
             "{{pool}} {{route}}"),
            ('sum by (changed) (rate(switchyard_cascade_escalations_total[$__rate_interval]))',
             "escalated, changed={{changed}}"),
        ], 0, 32),
        _panel(10, "Gateway overhead p99, shed and Redis", [
            ('histogram_quantile(0.99, sum by (le) '
             '(rate(switchyard_gateway_overhead_seconds_bucket[$__rate_interval])))',
             "overhead p99 (s)"),
            ("sum by (pool) (rate(switchyard_gateway_shed_requests_total[$__rate_interval]))",
             "shed {{pool}} /s"),
            ('histogram_quantile(0.99, sum by (op, le) '
             '(rate(switchyard_gateway_redis_latency_seconds_bucket[$__rate_interval])))',
             "redis {{op}} p99 (s)"),
            ("sum(rate(switchyard_gateway_quota_redis_errors_total[$__rate_interval]))",
             "redis errors /s"),
        ], 12, 32),
        _panel(11, "Auto routing: share per pool and route, escalated, overflowed", [
            (f"sum by (pool, route) ({decisions}) / ignoring (pool, route) group_left "
             f"sum ({decisions})", "{{pool}} by {{route}}"),
            (f'sum (rate(switchyard_cascade_escalations_total[$__rate_interval])) '
             f"/ sum ({decisions})", "escalated"),
            (f'sum (rate(switchyard_cascade_decisions_total{{route="overflow"}}'
             f"[$__rate_interval])) / sum ({decisions})", "overflowed"),
        ], 0, 40, unit="percentunit"),
        _panel(12, "Spend per hour by pool: tenants' and shadow runs'", [
            ("sum by (model) (rate(switchyard_gateway_spend_total[$__rate_interval])) * 3600",
             "{{model}} tenants"),
            ("sum by (pool) (rate(switchyard_gateway_shadow_spend_total[$__rate_interval]))"
             " * 3600", "{{pool}} shadow"),
        ], 12, 40, unit=CURRENCY_UNIT),
    ]  # fmt: skip
    return _dashboard("switchyard-fleet", "Switchyard / fleet", panels, [])


def main() -> None:
    for name, doc in (("tenant-usage.json", tenant_usage()), ("fleet.json", fleet())):
        (HERE / name).write_text(json.dumps(doc, indent=2) + "\n")
        print(HERE / name)


if __name__ == "__main__":
    main()
