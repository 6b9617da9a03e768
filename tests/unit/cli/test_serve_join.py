"""`switchyard serve --join REDIS_URL [--host-id ID]`: what it sets and what it refuses,
and the desired-replicas gauge the serve gateway exports."""

import socket
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from cli.commands.serve import join_fleet
from cli.serve.config import ServeConfig, lease_config, load_serve_config
from cli.serve.fleet_metrics import DESIRED_REPLICAS, export_desired_replicas


def test_join_shares_the_redis_turns_membership_on_and_names_the_host() -> None:
    cfg = ServeConfig()
    join_fleet(cfg, "redis://10.0.0.1:6379/0", None)
    assert cfg.redis_url == "redis://10.0.0.1:6379/0"  # no embedded Redis
    assert cfg.fleet.join and cfg.fleet.host_id == socket.gethostname()
    assert cfg.gateway.options["membership"] == {"enabled": True}
    other = ServeConfig()
    other.gateway.options["membership"] = {"poll_s": 0.5}
    join_fleet(other, "unix:///run/redis.sock", "host-b")
    assert other.fleet.host_id == "host-b"
    assert other.gateway.options["membership"] == {"poll_s": 0.5, "enabled": True}


def test_join_refuses_what_is_not_a_redis_url_or_a_host_id() -> None:
    with pytest.raises(SystemExit, match="--join takes a Redis URL"):
        join_fleet(ServeConfig(), "10.0.0.1:6379", None)
    with pytest.raises(SystemExit, match="--host-id: host id 'a/b'"):
        join_fleet(ServeConfig(), "redis://r:6379", "a/b")
    with pytest.raises(SystemExit, match="give --join too"):
        join_fleet(ServeConfig(), None, "host-b")


def test_fleet_join_in_the_config_needs_a_redis_url(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"fleet": {"join": True}}))
    with pytest.raises(SystemExit, match="fleet.join needs redis_url"):
        load_serve_config(path)
    path.write_text(yaml.safe_dump({"redis_url": "redis://r:1", "fleet": {"lease_ttl_s": 0.2}}))
    with pytest.raises(SystemExit, match="lease_ttl_s must be"):
        load_serve_config(path)
    path.write_text(yaml.safe_dump({"redis_url": "redis://r:1", "fleet": {"join": True}}))
    cfg = load_serve_config(path)
    assert cfg.fleet.join and lease_config(cfg).renew_every_s == 2.0


def test_the_desired_replicas_gauge_reads_the_autoscaler_at_scrape_time() -> None:
    registry = CollectorRegistry()
    desired = {"small": 3}
    export_desired_replicas(registry, lambda: desired)
    assert registry.get_sample_value(DESIRED_REPLICAS, {"pool": "small"}) == 3
    desired["small"] = 5
    desired["large"] = 1
    assert registry.get_sample_value(DESIRED_REPLICAS, {"pool": "small"}) == 5
    assert registry.get_sample_value(DESIRED_REPLICAS, {"pool": "large"}) == 1


def test_workers_listen_and_are_reached_on_the_fleet_worker_host(tmp_path: Path) -> None:
    from cli.serve.stack import RunOptions, worker_launches
    from workers.fleet.supervisor import Replica

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"fleet": {"worker_host": "0.0.0.0"}}))
    with pytest.raises(SystemExit, match="fleet.worker_host must be an address"):
        load_serve_config(path)
    cfg = ServeConfig()
    cfg.fleet.worker_host = "10.0.0.2"
    launches = worker_launches(cfg, {"small": tmp_path}, tmp_path / "run", RunOptions(None))
    argv = launches["small"].argv(8101)
    assert argv[argv.index("--host") + 1] == "10.0.0.2"
    assert launches["small"].host == "10.0.0.2"
    replica = Replica("small-0", "small", 0.0, port=8101, host=launches["small"].host)
    assert replica.url == "http://10.0.0.2:8101"
    assert Replica("small-1", "small", 0.0, port=8102, host="::1").url == "http://[::1]:8102"
