"""`switchyard serve` lists its workers for Prometheus (file_sd) as replicas come and go."""

import json

from cli.serve.fleet import PoolMembership
from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.pool import Pool


def test_membership_rewrites_the_prometheus_targets_file(tmp_path):
    pools = {n: Pool(n, [], None, QueueConfig(), 4) for n in ("small", "large")}  # type: ignore[arg-type]
    path = tmp_path / "prometheus" / "workers.json"
    members = PoolMembership(pools, path)
    assert json.loads(path.read_text()) == [
        {"targets": [], "labels": {"pool": "small"}},
        {"targets": [], "labels": {"pool": "large"}},
    ]
    members.add("small", "http://127.0.0.1:8101")
    members.add("small", "http://127.0.0.1:8103")
    members.add("large", "http://127.0.0.1:8102")
    members.remove("small", "http://127.0.0.1:8101", lost=False)
    groups = {g["labels"]["pool"]: g["targets"] for g in json.loads(path.read_text())}
    assert groups == {"small": ["127.0.0.1:8103"], "large": ["127.0.0.1:8102"]}
