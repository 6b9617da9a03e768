"""`switchyard serve` settings and local files, without starting anything."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli.serve.config import ServeConfig, defaults_yaml, load_serve_config
from cli.serve.stack import StartupError, check_port_free
from cli.serve.state import admin_key, local_admin_key, write_pointer
from tests.support.servers import REPO_ROOT


def test_relative_paths_resolve_against_the_config_file_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    path = conf / "serve.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data_dir": "../state",
                "pools": {"small": {"model_dir": "m/small"}},
                "cascade": {"enabled": False},
            }
        )
    )
    monkeypatch.chdir("/")
    cfg = load_serve_config(path)
    assert cfg.path(cfg.data_dir) == tmp_path / "state"
    assert cfg.path(cfg.pools["small"].model_dir) == conf / "m" / "small"


def test_unknown_keys_and_bad_cascade_pools_are_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"pools": {"small": {"engine": {"dtyp": "float32"}}}}))
    with pytest.raises(SystemExit, match=r"pools.small.engine: unknown keys \['dtyp'\]"):
        load_serve_config(path)
    path.write_text(yaml.safe_dump({"pools": {"small": {}}, "cascade": {"enabled": True}}))
    with pytest.raises(SystemExit, match="cascade pool 'large'"):
        load_serve_config(path)


def test_several_gateway_processes_are_refused_pointing_at_gateway_workers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"options": {"processes": 2}}}))
    with pytest.raises(SystemExit, match=r"processes must be 1: .*gateway --workers N"):
        load_serve_config(path)


def test_the_shipped_config_loads_and_every_default_is_in_help() -> None:
    cfg = load_serve_config(REPO_ROOT / "configs" / "serve.yaml")
    assert set(cfg.pools) == {"small", "large"}
    assert {p.model for p in cfg.pools.values()} == {"smollm2-135m-instruct"}
    assert cfg.cascade.enabled and cfg.cascade.target_fraction
    doc = yaml.safe_load(defaults_yaml())
    assert set(doc) == set(ServeConfig.__dataclass_fields__) - {"base_dir"}
    out = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    ).stdout
    assert "target_fraction: 0.3" in out and "stall_restart_s" in out


def test_a_taken_port_is_one_line_naming_the_option() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StartupError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            check_port_free("127.0.0.1", port, "--port")
        done = subprocess.run(
            [sys.executable, "-m", "cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use; choose another with --port or "
        f"gateway.port in configs/serve.yaml"
    ]


def test_the_admin_key_is_generated_once_private_and_found_for_the_local_url(
    tmp_path: Path,
) -> None:
    key, path, created = admin_key(tmp_path / "data")
    assert created and path.stat().st_mode & 0o777 == 0o600
    assert admin_key(tmp_path / "data") == (key, path, False)
    write_pointer(tmp_path / "cache", "http://127.0.0.1:8000", tmp_path / "data", path)
    assert local_admin_key(tmp_path / "cache", "http://127.0.0.1:8000/") == key
    assert local_admin_key(tmp_path / "cache", "http://10.0.0.1:8000") is None


def test_a_sharded_pool_starts_each_replica_as_a_group_and_refuses_unsplittable_models(
    tmp_path: Path, llama_dir: Path
) -> None:
    from cli.serve.stack import RunOptions, ensure_models, worker_launches

    path = tmp_path / "serve.yaml"
    pools = {
        "big": {"model_dir": str(llama_dir), "tensor_parallel": 2, "min_replicas": 1},
        "small": {"model_dir": str(llama_dir), "min_replicas": 1},
    }
    path.write_text(yaml.safe_dump({"pools": pools, "cascade": {"enabled": False}}))
    cfg = load_serve_config(path)
    dirs = ensure_models(cfg, tmp_path)
    launches = worker_launches(cfg, dirs, tmp_path / "run", RunOptions(path))
    big, small = launches["big"].argv(9000), launches["small"].argv(9001)
    assert big[big.index("--tensor-parallel") + 1] == "2"
    assert "--tensor-parallel" not in small
    # llama_dir has 4 attention heads and 2 KV heads: 4 ranks cannot hold them.
    cfg.pools["big"].tensor_parallel = 4
    with pytest.raises(StartupError, match=r"pools\.big\.tensor_parallel: .*2 KV heads"):
        ensure_models(cfg, tmp_path)
    path.write_text(yaml.safe_dump({"pools": {"x": {"tensor_parallel": 0}}}))
    with pytest.raises(SystemExit, match="tensor_parallel must be"):
        load_serve_config(path)


def test_the_shipped_config_places_one_core_per_replica_on_two_cores_and_never_more() -> None:
    """configs/serve.yaml on this 2-core machine: small and large each warm on a core of its
    own; small's second replica would need a third core, so it is never started while
    large holds one (the tour ran 5 engine processes on 2 cores)."""
    from cli.serve.config import placements
    from workers.fleet.devices import DeviceInventory

    cfg = load_serve_config(REPO_ROOT / "configs" / "serve.yaml")
    placed = placements(cfg, {"cpu": [0, 1]})
    assert {n: (p.kind, p.count) for n, p in placed.items()} == {
        "small": ("cpu", 1),
        "large": ("cpu", 1),
    }
    inventory = DeviceInventory({"cpu": [0, 1]})
    inventory.take("small-0", "small", placed["small"])
    inventory.take("large-1", "large", placed["large"])
    assert inventory.startable(placed["small"]) == 0
    # On 8 cores, small at its max (2) and large (1) get 8 // 3 = 2 cores a replica.
    assert {p.count for p in placements(cfg, {"cpu": list(range(8))}).values()} == {2}


def test_warm_replicas_that_do_not_fit_the_host_are_refused_at_start_naming_the_numbers() -> None:
    from cli.serve.config import PoolSection, placements

    cfg = ServeConfig(
        pools={
            "small": PoolSection(min_replicas=2, cores_per_rank=1),
            "large": PoolSection(min_replicas=1, tensor_parallel=2, cores_per_rank=1),
        }
    )
    with pytest.raises(SystemExit, match=r"need 4 cpu devices \(small 2 x 1, large 1 x 2\)"):
        placements(cfg, {"cpu": [0, 1]})
    gpu = ServeConfig(
        pools={"big": PoolSection(tensor_parallel=2, engine={"device": "cuda"})},
        cascade=ServeConfig().cascade,
    )
    (placement,) = placements(gpu, {"cuda": [0, 1, 2, 3]}).values()
    assert (placement.kind, placement.per_rank, placement.ranks) == ("cuda", 1, 2)
