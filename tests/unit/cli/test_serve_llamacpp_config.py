"""`kind: llamacpp` serve pools without starting anything: the shipped config, the refused
combinations (each naming its key), the command lines, what the gateway is told, and how
a /slots answer is read."""

from pathlib import Path

import pytest
import yaml

from cli.serve.config import load_serve_config
from cli.serve.llamacpp import llamacpp_argv, num_processing
from cli.serve.stack import gateway_config
from tests.support.servers import REPO_ROOT


def load(tmp_path: Path, large: dict, **top) -> object:
    path = tmp_path / "serve.yaml"
    doc = {"pools": {"small": {}, "large": {"kind": "llamacpp", **large}}, **top}
    path.write_text(yaml.safe_dump(doc))
    return load_serve_config(path)


def test_the_shipped_llamacpp_config_serves_large_on_one_fixed_llama_server(
    tmp_path: Path,
) -> None:
    cfg = load_serve_config(REPO_ROOT / "configs" / "serve-llamacpp.yaml")
    small, large = cfg.pools["small"], cfg.pools["large"]
    assert (small.kind, small.min_replicas, small.max_replicas) == ("switchyard", 1, 2)
    assert (large.kind, large.min_replicas, large.max_replicas) == ("llamacpp", 1, 1)
    assert large.argv is None and large.model == small.model
    assert cfg.cascade.enabled and (cfg.cascade.small_pool, cfg.cascade.large_pool) == (
        "small",
        "large",
    )
    gc = gateway_config(cfg, {"small": tmp_path / "smollm2"}, tmp_path, "k")
    assert gc.upstreams["large"].kind == "llamacpp" and "small" not in gc.upstreams
    assert gc.pools == {"small": [], "large": []}
    assert gc.tokenizers["large"] == str(tmp_path / "smollm2")  # the same model's tokenizer


def test_a_llamacpp_pool_without_replicas_is_one_and_replicas_fixes_its_size(
    tmp_path: Path,
) -> None:
    assert load(tmp_path, {}).pools["large"].max_replicas == 1
    cfg = load(tmp_path, {"replicas": 3})
    assert (cfg.pools["large"].min_replicas, cfg.pools["large"].max_replicas) == (3, 3)


@pytest.mark.parametrize(
    ("large", "error"),
    [
        ({"min_replicas": 1, "max_replicas": 3}, r"pools.large: a llamacpp pool is fixed-size"),
        ({"replicas": 2, "max_replicas": 2}, r"give replicas or max_replicas, not both"),
        ({"replicas": 0}, r"pools.large.replicas must be a whole number >= 1"),
        ({"engine": {"dtype": "float32"}}, r"\['engine'\] are for Switchyard workers"),
        ({"autoscaler": {"scale_up_window_s": 5}}, r"\['autoscaler'\] are for Switchyard"),
        ({"command": "llama-server -m x.gguf --port 9000"}, r"command may not set \['--port'\]"),
        ({"command": ["llama-server", "--host=0.0.0.0"]}, r"may not set \['--host'\]"),
        ({"command": "llama-server", "llama_server": {"slots": 2}}, r"only without a command"),
        ({"llama_server": {"slots": 0}}, r"llama_server.slots must be a whole number >= 1"),
        ({"llama_server": {"slot": 2}}, r"pools.large.llama_server: unknown keys \['slot'\]"),
        ({"model": "demo-large"}, r"demo-large has no GGUF"),
        ({"upstream": {"kind": "vllm"}}, r"upstream may not set kind"),
        ({"upstream": {"max_concurency": 2}}, r"upstream: unknown keys \['max_concurency'\]"),
        ({"kind": "vllm"}, r"kind must be one of \['switchyard', 'llamacpp'\]"),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_key(
    tmp_path: Path, large: dict, error: str
) -> None:
    with pytest.raises(SystemExit, match=error):
        load(tmp_path, large)


def test_a_command_is_for_llamacpp_pools_only(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"pools": {"small": {"command": "llama-server"}}}))
    with pytest.raises(SystemExit, match="pools.small: command and upstream are for kind"):
        load_serve_config(path)


def test_a_pools_own_command_gets_each_replicas_port_and_the_default_has_slots_and_metrics(
    tmp_path: Path,
) -> None:
    cfg = load(tmp_path, {"command": "/opt/llama-server -m '/m/a b.gguf' -np 8"})
    argv = llamacpp_argv("large", cfg.pools["large"], None, 1)(4321)
    assert argv == ["/opt/llama-server", "-m", "/m/a b.gguf", "-np", "8"] + [
        "--host",
        "127.0.0.1",
        "--port",
        "4321",
    ]
    cfg = load(tmp_path, {"llama_server": {"slots": 3, "ctx_per_slot": 256}})
    files = (Path("/bin/llama-server"), Path("/m/x.gguf"))
    argv = llamacpp_argv("large", cfg.pools["large"], files, 2)(5555)
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1)}
    assert pairs["-np"] == "3" and pairs["-c"] == "768" and pairs["--port"] == "5555"
    assert pairs["-t"] == "2" and pairs["--alias"] == "large" and pairs["-m"] == "/m/x.gguf"
    assert {"--metrics", "--slots"} <= set(argv)


def test_slots_processing_are_counted_and_anything_else_is_unknown() -> None:
    busy = b'[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]'
    assert num_processing(busy) == 1
    assert num_processing(b'[{"id":0,"is_processing":"yes"}]') == 0
    assert num_processing(b'{"error":"slots disabled"}') is None
    assert num_processing(b"not json") is None
    assert num_processing(b"[" + b"{}," * 400_000 + b"{}]") is None  # past the size bound
