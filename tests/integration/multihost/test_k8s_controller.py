"""The controller of deploy/kubernetes/controller.yaml, run with its own config and command
line on one "pod" (host A, with the fleet's Redis) beside a worker pod joining the pool from
host B: it starts, runs no worker of its own, routes to the joined pod, and exports on its
/metrics the desired replica count the scalers read: the leader counts the joined pod as
one of the pool's replicas (no supervisor runs it), so the count is 1, not the pool's
min_replicas of 0, as the README says; it orders no start on itself (no room)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.k8s_manifests import MANIFEST_DIR, documents
from tests.support.netns import TwoHosts, start_redis
from tests.support.servers import REPO_ROOT, wait_ready

ADMIN_KEY = "controller-test-admin"


def _manifest(kind: str, name: str) -> dict:
    (doc,) = [
        d
        for d in documents(MANIFEST_DIR / "controller.yaml")
        if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    return doc


def _desired(text: str) -> dict[str, float]:
    return {
        sample.labels["pool"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "switchyard_autoscaler_desired_replicas"
    }


def test_the_controller_runs_no_worker_and_exports_the_desired_count(
    hosts: TwoHosts, demo_dir: Path, tmp_path: Path
) -> None:
    redis_url = start_redis(hosts.a, tmp_path / "redis")
    # The ConfigMap's serve.yaml, with the cluster's paths and addresses made this test's.
    config = yaml.safe_load(
        _manifest("ConfigMap", "switchyard-controller-config")["data"]["serve.yaml"]
    )
    config["data_dir"] = str(tmp_path / "data")
    config["redis_url"] = redis_url
    for pool in config["pools"].values():
        pool["model_dir"] = str(demo_dir)
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    (container,) = _manifest("Deployment", "switchyard-controller")["spec"]["template"]["spec"][
        "containers"
    ]
    argv = [
        arg.replace("/etc/switchyard/serve.yaml", str(config_path))
        .replace("redis://switchyard-redis:6379/0", redis_url)
        .replace("$(POD_NAME)", "controller-pod")
        for arg in container["args"]
    ]
    env = {**os.environ, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY}
    env["SWITCHYARD_CACHE"] = str(tmp_path / "cache")

    worker_url = f"http://{hosts.b.address}:8100"
    with open(tmp_path / "worker.log", "wb") as log:
        worker = hosts.b.popen(
            [sys.executable, "-m", "cli.main", "worker", "--model", str(demo_dir)]
            + ["--host", hosts.b.address, "--port", "8100", "--control-key", "k"]
            + ["--join", redis_url, "--pool", "small", "--host-id", "worker-pod"],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    hosts.b.call(lambda: wait_ready(worker_url, 180.0, worker))
    with open(tmp_path / "controller.log", "wb") as log:
        controller = hosts.a.popen(
            [sys.executable, "-m", "cli.main", *argv],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    port = config["gateway"]["port"]
    url = f"http://{hosts.a.address}:{port}"  # from host A's address: in metrics_networks
    hosts.a.call(lambda: wait_ready(url, 240.0, controller))  # ready: it routes to the pod

    def desired_now() -> dict[str, float]:
        deadline = time.monotonic() + 60
        while True:
            answer = httpx.get(f"{url}/metrics", timeout=10)
            assert answer.status_code == 200, answer.text
            desired = _desired(answer.text)
            if desired or time.monotonic() > deadline:
                return desired
            time.sleep(0.2)

    # The joined pod is a replica of the pool: the floor (min_replicas 0) does not drain it
    # (and a new leader drains nothing within its first scale-down window anyway).
    assert hosts.a.call(desired_now) == {"small": 1.0}

    def fleet() -> dict:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.get(f"{url}/admin/fleet", headers=headers, timeout=10).json()

    small = hosts.a.call(fleet)["small"]
    assert small["replicas"] == []  # its supervisor runs nothing
    assert small["fleet"]["leader"] is True
    member = f"member/{hosts.b.address}:8100"  # the pod, counted by the leader
    assert [r["replica_id"] for r in small["signals"]["replicas"]] == [member]
    assert small["fleet"]["orders_applied"] == 0  # no start was ordered to it
    assert [w["url"] for w in small["workers"]] == [worker_url]  # the pod, from Redis
    # No worker process under the controller: only what serve itself needs, if anything.
    children = psutil.Process(controller.pid).children(recursive=True)
    assert not [c for c in children if "worker" in " ".join(c.cmdline())], children
    assert controller.poll() is None
