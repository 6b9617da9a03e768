"""dashboards/: every metric the Grafana dashboards and the alert rules name is one the code
exports (gateway, cascade, quota and worker registries), every panel's query parses, the rules
pass `promtool check rules` and their unit tests `promtool test rules alerts_test.yml`
(promtool comes with the `prometheus` system package, installed by scripts/setup.sh; without
it this test fails unless SWITCHYARD_SKIP_PROMTOOL=1 says to skip that step)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from workers.engine.stats import EngineStats
from workers.server.metrics import EngineCollector, WorkerMetrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
METRIC = re.compile(r"\b(switchyard_[a-z0-9_]+)")
PROMETHEUS_BUILTINS = {"up"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def _idle_engine_stats() -> EngineStats:
    return EngineStats(
        time_s=0.0,
        num_steps=0,
        num_running=0,
        waiting_tokens=(),
        num_held=0,
        max_num_seqs=16,
        block_size=16,
        kv_blocks_used=0,
        kv_blocks_free=64,
        kv_blocks_total=64,
        prefix_cache_query_tokens=0,
        prefix_cache_hit_tokens=0,
        num_preemptions=0,
        num_failed_requests=0,
        num_generated_tokens=0,
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    cfg = GatewayConfig(
        pools={"small": ["http://127.0.0.1:9"], "large": ["http://127.0.0.1:9"]},
        data_dir=str(tmp_path_factory.mktemp("gw")),
        cascade_small_pool="small",
        cascade_large_pool="large",
    )
    gw = build_gateway(cfg, "redis://127.0.0.1:9/0")  # nothing connects until used
    worker = CollectorRegistry()
    WorkerMetrics(worker, "small")
    worker.register(EngineCollector(_idle_engine_stats, "small"))
    return exported_names(gw.registry) | exported_names(worker)


def _dashboard_exprs(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    for var in doc["templating"]["list"]:
        if var.get("type") == "query":
            exprs.append(var["definition"])
    return exprs


def _rule_exprs() -> list[str]:
    doc = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def test_dashboards_and_rules_use_only_exported_metrics(exported):
    files = sorted(DASHBOARDS.glob("*.json"))
    assert {f.name for f in files} >= {"tenant-usage.json", "fleet.json"}
    exprs = [e for f in files for e in _dashboard_exprs(f)] + _rule_exprs()
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert len(used) >= 20
    unknown = sorted(used - exported)
    assert not unknown, f"not exported by the code: {unknown}"
    # Worker metrics are in use too, and the tenant dashboard has its tenant variable.
    assert any(m.startswith("switchyard_worker_") for m in used)
    tenant = json.loads((DASHBOARDS / "tenant-usage.json").read_text())
    assert "tenant" in {v["name"] for v in tenant["templating"]["list"]}


def test_dashboards_are_current_with_their_builder():
    import runpy

    module = runpy.run_path(str(DASHBOARDS / "build.py"))
    for name, build in (("tenant-usage.json", "tenant_usage"), ("fleet.json", "fleet")):
        assert json.loads((DASHBOARDS / name).read_text()) == module[build](), name


def test_rules_are_valid_alerting_rules():
    doc = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    names = set()
    for group in doc["groups"]:
        assert set(group) == {"name", "rules"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
            assert rule["alert"] and rule["expr"] and rule["labels"]["severity"]
            names.add(rule["alert"])
    wanted = {"QueueDepth", "TTFTP99", "ErrorRate", "WorkerStalled", "RedisErrors"}
    assert all(any(w in n for n in names) for w in wanted), names
    assert "TenantNearBudget" in names
    promtool = _promtool()
    if promtool is None:
        return
    for args in (
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "alerts_test.yml"],  # TenantNearBudget: fires after 5m over 90 %
    ):
        _run(promtool, args, DASHBOARDS)


def test_alert_unit_tests_cover_the_budget_alert():
    doc = yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    tested = {t["alertname"] for case in doc["tests"] for t in case["alert_rule_test"]}
    assert "TenantNearBudget" in tested
    fired = [t for case in doc["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]]
    silent = [t for case in doc["tests"] for t in case["alert_rule_test"] if not t["exp_alerts"]]
    assert fired and silent  # it fires, and is shown not to fire too early


def test_dashboard_queries_parse(tmp_path):
    # Each panel's query as a recording rule, Grafana's variables filled in as Grafana would.
    fill = {"$__rate_interval": "1m", '"$tenant"': '".*"'}
    exprs = []
    for f in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(f.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in fill.items():
                    expr = expr.replace(var, value)
                assert "$" not in expr, (f.name, panel["title"], expr)
                exprs.append(expr)
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:query_{i}", "expr": e} for i, e in enumerate(exprs)
    ]}]}  # fmt: skip
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rules))
    promtool = _promtool()
    if promtool is not None:
        _run(promtool, ["check", "rules", "panels.yml"], tmp_path)


def _promtool() -> str | None:
    if os.environ.get("SWITCHYARD_SKIP_PROMTOOL") == "1":
        return None
    promtool = shutil.which("promtool")
    assert promtool, (
        "promtool not found: scripts/setup.sh installs it (apt-get install prometheus); "
        "SWITCHYARD_SKIP_PROMTOOL=1 skips this check explicitly"
    )
    return promtool


def _run(promtool: str, args: list[str], cwd: Path) -> None:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
