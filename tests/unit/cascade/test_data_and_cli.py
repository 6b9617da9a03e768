"""Dataset layouts and the `switchyard cascade` commands."""

import argparse
import json
import sys
from io import StringIO
from pathlib import Path

import pytest

from cascade.data import DatasetError, load_dataset
from cli.commands import cascade as cascade_command
from tests.unit.cascade.conftest import synthetic_rows, write_csv

ROUTELLM = ("mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview")


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="switchyard")
    cascade_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_routellm_directory_layout_uses_file_stems_as_groups(tmp_path: Path) -> None:
    rows = synthetic_rows(20)
    for r in rows:
        r["group"] = ""
    write_csv(tmp_path / "anatomy.csv", rows[:8], ROUTELLM)
    write_csv(tmp_path / "virology.csv", rows[8:], ROUTELLM)
    ds = load_dataset(tmp_path)
    assert len(ds.examples) == 20
    assert set(ds.groups) == {"anatomy", "virology"}
    assert [e.needs_large for e in ds.examples] == [
        (not r["weak_ok"]) and r["strong_ok"] for r in rows
    ]
    assert load_dataset(tmp_path).sha256 == ds.sha256


def test_jsonl_with_chat_messages_and_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hi"}], "weak_ok": 1, "strong_ok": "true"},
        {"prompt": "x", "weak_ok": False, "strong_ok": True, "tenant": "acme", "max_tokens": 9},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ds = load_dataset(path)
    assert ds.examples[0].view.text == "hi" and ds.examples[0].group == "traffic"
    assert ds.examples[1].group == "acme" and ds.examples[1].needs_large
    assert ds.examples[1].view.max_tokens == 9
    path.write_text(json.dumps({"prompt": "x", "weak_ok": "maybe", "strong_ok": True}) + "\n")
    with pytest.raises(DatasetError, match="row 1"):
        load_dataset(path)


def test_score_cli_prints_one_json_line_per_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"prompt": "What is 2 + 2?"},
        {"id": "c1", "messages": [{"role": "user", "content": "Explain the theorem."}]},
        "not json",
        {"neither": 1},
    ]
    stdin = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    monkeypatch.setattr(sys, "stdin", StringIO(stdin))
    assert run(["cascade", "score", "--explain", "2"]) == 1  # two bad lines
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(out) == 4
    assert 0.0 <= out[0]["score"] <= 1.0 and out[0]["fallback"] is False
    assert out[1]["id"] == "c1" and len(out[1]["explain"]) == 2
    assert "error" in out[2] and "error" in out[3]


def test_score_cli_reports_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", StringIO('{"prompt": "hello"}\n'))
    assert run(["cascade", "score", "--classifier", str(tmp_path / "missing")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fallback"] is True and out["scorer"] == "length-heuristic"


def test_train_and_eval_cli_on_a_tiny_dataset(synthetic_csv: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    argv = ["cascade", "train", "--quick", "--data", str(synthetic_csv), "--out", str(out)]
    assert run(argv) == 0
    assert (out / "manifest.json").is_file()
    report_dir = tmp_path / "eval"
    argv = [
        "cascade",
        "eval",
        "--data",
        str(synthetic_csv),
        "--out",
        str(report_dir),
        "--folds",
        "2",
        "--random-folds",
        "2",
        "--quick",
        "--classifier",
        str(out),
        "--bench-prompts",
        "50",
    ]
    assert run(argv) == 0
    report = json.loads((report_dir / "report.json").read_text())
    grouped = report["protocols"]["grouped"]
    assert grouped["pooled"]["oracle"]["apgr"] >= grouped["pooled"]["classifier"]["apgr"]
    assert grouped["pooled"]["random"]["apgr"] == pytest.approx(0.5)
    assert grouped["pooled"]["classifier"]["apgr"] > 0.6  # long = hard is learnable
    assert report["latency"]["dataset"]["num_prompts"] == 50
    assert (report_dir / "curve.png").stat().st_size > 10_000
    assert "prompt length" in (report_dir / "report.md").read_text()


def test_bench_score_cli_on_synthetic_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["cascade", "bench-score", "--num", "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_prompts"] == 100 and out["p99_ms"] >= out["p50_ms"] > 0
