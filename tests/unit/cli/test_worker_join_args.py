"""`switchyard worker --join`'s options: what it refuses before loading anything, each with
a one-line reason, and the membership it builds from good ones."""

import argparse
import json
import socket
from pathlib import Path

import pytest

from cli.commands.worker import join_config
from cli.main import build_parser, main


def checkpoint(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    return model


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(model: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", "--model", str(model), *extra])


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--join", "redis://127.0.0.1:6379"], "--join needs --pool"),
        (["--pool", "small"], "need --join"),
        (["--join", "redis://h:1", "--pool", "a b"], "pool name 'a b'"),
        (
            ["--join", "redis://h:1", "--pool", "small", "--host", "0.0.0.0", "--control-key", "k"],
            "give --advertise-url",
        ),
        (["--join", "redis://h:1", "--pool", "small", "--advertise-url", "http://h"], "port"),
        (["--join", "redis://h:1", "--pool", "small", "--join-ttl", "0"], "--join-ttl"),
    ],
)
def test_bad_join_options_are_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], why: str
) -> None:
    assert main(["worker", "--model", str(checkpoint(tmp_path)), *extra]) == 2
    assert why in capsys.readouterr().err


def test_a_redis_that_does_not_answer_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url = f"redis://127.0.0.1:{closed_port()}"
    model = str(checkpoint(tmp_path))
    assert main(["worker", "--model", model, "--join", url, "--pool", "small"]) == 2
    assert "Redis does not answer" in capsys.readouterr().err


def test_good_options_give_the_membership_the_worker_announces(tmp_path: Path) -> None:
    model = checkpoint(tmp_path)
    args = worker_args(model, "--port", "8123", "--join", "redis://h:1", "--pool", "small")
    join = join_config(args, "cpu", 64, model, "")
    assert join.advertise_url == "http://127.0.0.1:8123"
    assert join.pool == "small" and join.max_num_seqs == 64 and join.ttl_s == 6.0
    assert join.fingerprint.startswith("m1-") and join.host_id == socket.gethostname()
    assert join.devices and all(d.startswith("cpu:") for d in join.devices)
    args = worker_args(
        model, "--join", "redis://h:1", "--pool", "small", "--host", "0.0.0.0",
        "--advertise-url", "http://10.1.2.3:9000/", "--host-id", "node-7",
    )  # fmt: skip
    quantized = join_config(args, "cpu", 64, model, "quantization=int8")
    assert quantized.advertise_url == "http://10.1.2.3:9000" and quantized.host_id == "node-7"
    assert quantized.fingerprint != join.fingerprint  # another model as served
