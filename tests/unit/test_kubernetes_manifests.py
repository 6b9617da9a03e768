"""deploy/kubernetes/ does what its comments say: every document is valid for Kubernetes
1.33 (strict) or KEDA 2.16, every `switchyard` command line in it parses with the real CLI,
the configs it mounts load with the real loaders, and the pieces point at each other (worker
pods join their pool at their own pod IP, the scalers read the metric the controller
exports, for the Deployment of that pool)."""

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cli.main import build_parser
from tests.support.k8s_manifests import (
    UnknownKind,
    all_documents,
    manifest_files,
    validate_document,
)

DESIRED_METRIC = "switchyard_autoscaler_desired_replicas"
REDIS_URL = "redis://switchyard-redis:6379/0"
DOCS = all_documents()


def _find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _worker_deployments() -> list[dict[str, Any]]:
    return [
        d
        for d in _of_kind("Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app") == "switchyard-worker"
    ]


def _switchyard_containers() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for kind in ("Deployment", "StatefulSet"):
        for doc in _of_kind(kind):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["image"].split(":")[0].endswith("switchyard"):
                    out.append((f"{doc['metadata']['name']}/{c['name']}", c))
    return out


def _args(container: dict[str, Any]):
    return build_parser().parse_args(container["args"])


def _config_map_file(name: str, key: str) -> dict[str, Any]:
    return yaml.safe_load(_find("ConfigMap", name)["data"][key])


def test_the_manifests_hold_the_pieces_the_docs_name() -> None:
    names = {p.name for p in manifest_files()}
    assert {"redis.yaml", "gateway.yaml", "workers.yaml", "controller.yaml"} <= names
    assert {"scaling-keda.yaml", "scaling-hpa-external.yaml"} <= names
    assert _worker_deployments(), "no worker Deployment"


@pytest.mark.parametrize(("where", "doc"), DOCS, ids=[w for w, _ in DOCS])
def test_every_document_is_valid_for_its_api_strictly(where: str, doc: dict[str, Any]) -> None:
    validate_document(doc)


@pytest.mark.parametrize(
    ("where", "path", "value"),
    [
        (
            "workers.yaml: Deployment/switchyard-worker-small",
            ["spec", "template", "spec", "containers", 0, "preStopp"],
            {},
        ),
        (
            "gateway.yaml: HorizontalPodAutoscaler/switchyard-gateway",
            ["spec", "behaviour"],
            {},
        ),
        (
            "scaling-keda.yaml: ScaledObject/switchyard-worker-small",
            ["spec", "triggers", 0, "metadata", "threshold"],
            1,  # a number: the CRD's metadata is map[string]string
        ),
        (
            "scaling-keda.yaml: ScaledObject/switchyard-worker-small",
            ["spec", "triggers", 0, "metadata", "serverAdress"],
            "http://x",
        ),
        (
            "scaling-keda.yaml: ScaledObject/switchyard-worker-small",
            ["spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleUp", "x"],
            1,
        ),
    ],
)
def test_validation_refuses_a_misspelt_or_mistyped_field(
    where: str, path: list[Any], value: Any
) -> None:
    doc = copy.deepcopy(dict(DOCS)[where])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_document(doc)


def test_a_kind_no_schema_holds_is_an_error_not_a_pass() -> None:
    with pytest.raises(UnknownKind):
        validate_document(
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
        )
    with pytest.raises(UnknownKind):
        validate_document(
            {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledJob", "metadata": {"name": "j"}}
        )


@pytest.mark.parametrize(
    ("where", "container"), _switchyard_containers(), ids=[w for w, _ in _switchyard_containers()]
)
def test_every_switchyard_command_line_parses_with_the_cli(
    where: str, container: dict[str, Any]
) -> None:
    try:
        _args(container)
    except SystemExit as exc:  # argparse's way of refusing: a renamed or removed flag
        pytest.fail(f"{where}: `switchyard {' '.join(container['args'])}` does not parse ({exc})")
    # Kubernetes leaves an undefined $(VAR) in args as it is, silently: each must be set.
    defined = {e["name"] for e in container.get("env", [])}
    for arg in container["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in defined, f"{where}: {arg} uses $({var}), which env does not set"


def test_worker_pods_join_their_pool_at_their_own_pod_ip() -> None:
    for deployment in _worker_deployments():
        pool = deployment["spec"]["template"]["metadata"]["labels"]["pool"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = _args(container)
        (port,) = [p["containerPort"] for p in container["ports"]]
        assert args.command == "worker"
        assert args.join == REDIS_URL
        assert args.pool == pool
        assert args.port == port
        assert args.advertise_url == f"http://$(POD_IP):{port}"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert deployment["metadata"]["name"] == f"switchyard-worker-{pool}"


def test_worker_pods_drain_before_they_stop() -> None:
    for deployment in _worker_deployments():
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "-c"]
        compile(command[2], "preStop", "exec")  # the hook is Python that compiles
        assert "/drain" in command[2] and "SWITCHYARD_WORKER_CONTROL_KEY" in command[2]
        env = {e["name"] for e in container["env"]}
        assert "SWITCHYARD_WORKER_CONTROL_KEY" in env
        assert spec["terminationGracePeriodSeconds"] >= 60


def test_no_service_stands_for_a_worker_pool() -> None:
    """Gateways find each worker pod through Redis; a Service in front of a pool would make
    a whole Deployment one replica."""
    worker_labels = {"app": "switchyard-worker"}
    for service in _of_kind("Service"):
        selector = service["spec"].get("selector", {})
        assert not worker_labels.items() <= selector.items(), service["metadata"]["name"]


def test_the_gateway_scales_on_cpu() -> None:
    hpa = _find("HorizontalPodAutoscaler", "switchyard-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "switchyard-gateway",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    gateway = _find("Deployment", "switchyard-gateway")
    assert "replicas" not in gateway["spec"], "the HPA owns the gateway's replicas"
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"], "utilization is of the CPU request"


def _pool_of_target(scale_target: dict[str, Any]) -> str:
    deployment = _find("Deployment", scale_target["name"])
    assert deployment in _worker_deployments()
    return deployment["spec"]["template"]["metadata"]["labels"]["pool"]


def test_keda_scales_each_worker_pool_to_the_desired_replicas() -> None:
    objects = _of_kind("ScaledObject")
    assert {o["spec"]["scaleTargetRef"]["name"] for o in objects} == {
        d["metadata"]["name"] for d in _worker_deployments()
    }
    for scaled in objects:
        pool = _pool_of_target(scaled["spec"]["scaleTargetRef"])
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        # AverageValue with threshold 1: the HPA KEDA makes sets ceil(metric / 1) replicas.
        assert trigger["metricType"] == "AverageValue"
        assert float(trigger["metadata"]["threshold"]) == 1.0
        assert trigger["metadata"]["query"] == f'max({DESIRED_METRIC}{{pool="{pool}"}})'


def test_the_external_metric_hpa_scales_each_worker_pool_to_the_desired_replicas() -> None:
    hpas = [
        h
        for h in _of_kind("HorizontalPodAutoscaler")
        if h["metadata"]["name"] != "switchyard-gateway"
    ]
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {
        d["metadata"]["name"] for d in _worker_deployments()
    }
    rules = _config_map_file("switchyard-prometheus-adapter-rules", "config.yaml")
    (rule,) = rules["externalRules"]
    assert DESIRED_METRIC in rule["seriesQuery"]
    for hpa in hpas:
        pool = _pool_of_target(hpa["spec"]["scaleTargetRef"])
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == rule["name"]["as"] == DESIRED_METRIC
        assert metric["external"]["metric"]["selector"] == {"matchLabels": {"pool": pool}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_the_worker_config_loads_with_the_worker_loader() -> None:
    from cli.config_files import fill
    from workers.server.config import WorkerConfig

    raw = _config_map_file("switchyard-worker-config", "worker.yaml")
    config = fill(WorkerConfig, raw["worker"], "worker.yaml")
    assert config.exit_when_drained is False  # the pod exits at SIGTERM, after preStop


def test_every_mounted_config_map_key_exists() -> None:
    """A container's --config names a file its ConfigMap volume holds."""
    for where, container in _switchyard_containers():
        args = _args(container)
        if getattr(args, "config", None) is None:
            continue
        path = Path(args.config)
        mount = next(m for m in container["volumeMounts"] if path.parent == Path(m["mountPath"]))
        deployment = next(
            d
            for kind in ("Deployment", "StatefulSet")
            for d in _of_kind(kind)
            if container in d["spec"]["template"]["spec"]["containers"]
        )
        volume = next(
            v
            for v in deployment["spec"]["template"]["spec"]["volumes"]
            if v["name"] == mount["name"]
        )
        data = _find("ConfigMap", volume["configMap"]["name"])["data"]
        assert path.name in data, f"{where}: {path.name} not in {sorted(data)}"


def test_the_gateway_takes_its_pools_members_from_redis_only() -> None:
    from cli.config_files import fill
    from gateway.config import GatewayConfig, split_pool_entries

    raw = _config_map_file("switchyard-gateway-config", "gateway.yaml")
    config = fill(GatewayConfig, split_pool_entries(raw["gateway"]), "gateway.yaml")
    assert config.redis_url == REDIS_URL
    assert config.membership.enabled and config.membership.pools is None
    # No static URL: no Service standing for a Deployment, every member from Redis.
    assert config.pools and all(urls == [] for urls in config.pools.values())
    worker_pools = {
        d["spec"]["template"]["metadata"]["labels"]["pool"] for d in _worker_deployments()
    }
    assert set(config.pools) == worker_pools


def test_the_scalers_read_the_metric_the_serve_gateway_exports() -> None:
    from cli.serve.fleet_metrics import DESIRED_REPLICAS

    assert DESIRED_REPLICAS == DESIRED_METRIC


def _controller_config(tmp_path: Path):  # noqa: ANN202 (cli.serve.config.ServeConfig)
    from cli.serve.config import load_serve_config

    path = tmp_path / "serve.yaml"
    path.write_text(_find("ConfigMap", "switchyard-controller-config")["data"]["serve.yaml"])
    return load_serve_config(path)


def test_the_controller_is_a_fleet_host_that_never_runs_a_worker(tmp_path: Path) -> None:
    from cli.serve.config import placements
    from workers.fleet.devices import DeviceInventory

    (container,) = _find("Deployment", "switchyard-controller")["spec"]["template"]["spec"][
        "containers"
    ]
    args = _args(container)
    assert args.command == "serve" and args.join == REDIS_URL
    config = _controller_config(tmp_path)
    assert config.fleet.join and config.redis_url == REDIS_URL
    worker_pools = {
        d["spec"]["template"]["metadata"]["labels"]["pool"] for d in _worker_deployments()
    }
    assert set(config.pools) == worker_pools
    # No room for one replica even on a 1,024-core node: the leader places nothing here,
    # and serve has no warm replica to refuse.
    cores = {"cpu": list(range(1024))}
    placed = placements(config, cores)  # type: ignore[arg-type]
    inventory = DeviceInventory(cores)  # type: ignore[arg-type]
    for name, pool in config.pools.items():
        assert pool.min_replicas == 0
        assert inventory.startable(placed[name]) == 0


def test_the_scalers_bounds_stay_within_the_pools_max_replicas(tmp_path: Path) -> None:
    pools = _controller_config(tmp_path).pools
    for scaled in _of_kind("ScaledObject"):
        pool = _pool_of_target(scaled["spec"]["scaleTargetRef"])
        assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
        assert scaled["spec"]["maxReplicaCount"] == pools[pool].max_replicas
    for hpa in _of_kind("HorizontalPodAutoscaler"):
        if hpa["metadata"]["name"] == "switchyard-gateway":
            continue
        pool = _pool_of_target(hpa["spec"]["scaleTargetRef"])
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["maxReplicas"] == pools[pool].max_replicas
