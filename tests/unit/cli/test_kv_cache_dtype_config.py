"""`engine.kv_cache_dtype` from the worker's YAML and a serve pool's engine settings to the
EngineConfig each worker builds."""

from pathlib import Path

import pytest
import yaml

from cli.config_files import fill, read_yaml
from cli.serve.config import load_serve_config
from tests.support.servers import REPO_ROOT
from workers.engine.config import EngineConfig


def test_the_shipped_configs_say_what_was_measured() -> None:
    """The plain worker stays the fp32 parity reference; the stack's pools run the measured
    defaults (int8 KV, q4 weights: README, "Quantized weights and the int8 KV cache")."""
    worker = read_yaml(REPO_ROOT / "configs" / "worker.yaml")
    reference = fill(EngineConfig, worker["engine"], "worker.yaml")
    assert (reference.kv_cache_dtype, reference.quantization) == ("auto", "none")
    serve = load_serve_config(REPO_ROOT / "configs" / "serve.yaml")
    for name, pool in serve.pools.items():
        engine = fill(EngineConfig, pool.engine, name)
        assert (engine.kv_cache_dtype, engine.quantization) == ("int8", "q4"), name


def test_a_pools_int8_reaches_its_workers_engine_config(tmp_path: Path, llama_dir: Path) -> None:
    from cli.serve.stack import RunOptions, ensure_models, worker_launches

    path = tmp_path / "serve.yaml"
    pools = {
        "small": {"model_dir": str(llama_dir), "engine": {"kv_cache_dtype": "int8"}},
        "large": {"model_dir": str(llama_dir)},
    }
    path.write_text(yaml.safe_dump({"pools": pools, "cascade": {"enabled": False}}))
    cfg = load_serve_config(path)
    launches = worker_launches(
        cfg, ensure_models(cfg, tmp_path), tmp_path / "run", RunOptions(path)
    )
    configs = {}
    for name, launch in launches.items():
        argv = launch.argv(9000)
        worker_yaml = read_yaml(Path(argv[argv.index("--config") + 1]))
        configs[name] = fill(EngineConfig, worker_yaml["engine"], name)
    assert configs["small"].kv_cache_dtype == "int8"
    assert configs["large"].kv_cache_dtype == "auto"


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    pools = {"small": {"engine": {"kv_cache_dtype": "fp8"}}}
    path.write_text(yaml.safe_dump({"pools": pools, "cascade": {"enabled": False}}))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, not 'fp8'"):
        load_serve_config(path)
