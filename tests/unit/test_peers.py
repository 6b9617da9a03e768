"""The peer tools' pure parts: GuideLLM report parsing and scenario building, the
llama-server command line, the cache keys. No build, no network, no subprocess."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.peers import guidellm as gl
from benchmarks.peers import llama_server as ls

REPORT = Path(__file__).parent / "data" / "guidellm_report.json"

CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
cpu MHz\t\t: 2100.000
flags\t\t: fpu sse sse2 avx avx2 avx512f

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
cpu MHz\t\t: 2200.000
flags\t\t: fpu sse sse2 avx avx2 avx512f
"""


def _no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached call must not run anything")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


# -- GuideLLM report --------------------------------------------------------------------


def test_parse_report_reads_every_level_of_a_real_guidellm_report() -> None:
    levels = gl.load_report(REPORT)

    assert [lv.label for lv in levels] == [
        "synchronous",
        "throughput@8",
        "constant@1",
        "concurrent@2",
        "synchronous",
    ]
    sync = levels[0]
    assert (sync.num_successful, sync.num_errored, sync.num_incomplete) == (5, 0, 1)
    assert sync.requests_per_s == pytest.approx(0.5)
    assert sync.ttft_p50_ms == pytest.approx(372.37, abs=0.01)
    assert sync.ttft_p99_ms == pytest.approx(510.91, abs=0.01)
    assert sync.itl_p50_ms == pytest.approx(48.12, abs=0.01)
    assert sync.output_tokens_per_s == pytest.approx(16.2)
    assert sync.duration_s == 10.0
    assert levels[1].concurrency == 8
    assert levels[2].target_rate == 1.0
    assert levels[3].concurrency == 2 and levels[3].num_successful == 14


def test_parse_report_counts_errors_and_leaves_latency_unknown_when_nothing_succeeded() -> None:
    wrong_key = gl.load_report(REPORT)[-1]

    assert wrong_key.num_successful == 0
    assert wrong_key.num_errored == 628
    assert wrong_key.ttft_p50_ms is None and wrong_key.itl_p99_ms is None
    assert wrong_key.requests_per_s == 0.0


def test_parse_level_reads_p50_and_p99_not_their_neighbours() -> None:
    benchmark = json.loads(REPORT.read_text())["benchmarks"][0]
    for name in ("time_to_first_token_ms", "inter_token_latency_ms"):
        benchmark["metrics"][name]["successful"]["percentiles"] = {
            "p50": 1.0,
            "p95": 2.0,
            "p99": 3.0,
        }

    level = gl.parse_level(benchmark)

    assert (level.ttft_p50_ms, level.ttft_p99_ms) == (1.0, 3.0)
    assert (level.itl_p50_ms, level.itl_p99_ms) == (1.0, 3.0)


def test_parse_report_without_benchmarks_is_an_error() -> None:
    with pytest.raises(gl.GuideLLMError, match="benchmarks"):
        gl.parse_report({"metadata": {}})


def test_format_table_has_a_row_per_level_and_dashes_for_unknown_latency() -> None:
    table = gl.format_table(gl.load_report(REPORT)).splitlines()

    assert len(table) == 2 + 5
    assert table[0].split()[:2] == ["level", "req/s"]
    assert table[2].split()[:5] == ["synchronous", "0.50", "5", "0", "1"]
    assert table[-1].split()[3] == "628" and "-" in table[-1].split()


# -- GuideLLM scenario and environment --------------------------------------------------


def test_parse_data_spec_makes_a_synthetic_source_with_int_values() -> None:
    assert gl.parse_data_spec("prompt_tokens=256,output_tokens=64") == {
        "kind": "synthetic_text",
        "prompt_tokens": 256,
        "output_tokens": 64,
    }
    with pytest.raises(ValueError, match="key=value"):
        gl.parse_data_spec("prompt_tokens")


def test_profile_args_reads_rate_by_profile() -> None:
    assert gl.profile_args("sweep", 3) == {"kind": "sweep", "sweep_size": 3}
    assert gl.profile_args("sweep")["sweep_size"] == 10
    assert gl.profile_args("constant", [0.5, 2]) == {"kind": "constant", "rate": [0.5, 2.0]}
    assert gl.profile_args("concurrent", 4) == {"kind": "concurrent", "streams": [4]}
    assert gl.profile_args("throughput", max_concurrency=8)["max_concurrency"] == 8
    assert gl.profile_args("synchronous") == {"kind": "synchronous"}
    with pytest.raises(ValueError, match="at least 2"):
        gl.profile_args("sweep", 1)
    with pytest.raises(ValueError, match="needs rate"):
        gl.profile_args("poisson")
    with pytest.raises(ValueError, match="profile must be"):
        gl.profile_args("knee")


def test_build_scenario_points_at_the_local_tokenizer_and_holds_no_secret(
    tmp_path: Path,
) -> None:
    scenario = gl.build_scenario(
        "http://127.0.0.1:8000/v1",
        "m",
        tmp_path / "tok",
        profile=gl.profile_args("sweep", 2),
        max_seconds=10,
        data=gl.parse_data_spec("prompt_tokens=8,output_tokens=4"),
        report_path=tmp_path / "report.json",
        max_requests=50,
        warmup_s=2,
    )
    spec = scenario["spec"]

    assert spec["backend"] == {
        "kind": "openai_http",
        "target": "http://127.0.0.1:8000/v1",
        "model": "m",
    }
    assert spec["tokenizer"]["model"] == str(tmp_path / "tok")
    assert {"kind": "max_duration", "seconds": 10} in spec["constraints"]
    assert {"kind": "max_requests", "count": 50} in spec["constraints"]
    assert spec["profile"]["warmup"] == {"mode": "duration", "value": 2}
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "report.json")}]
    assert "api_key" not in json.dumps(scenario)


def test_guidellm_env_is_offline_and_carries_the_key_only_when_given() -> None:
    env = gl.guidellm_env("sk-secret", max_worker_processes=2)

    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["GUIDELLM__SPEC__BACKEND__API_KEY"] == "sk-secret"
    assert env["GUIDELLM__MAX_WORKER_PROCESSES"] == "2"
    assert "GUIDELLM__SPEC__BACKEND__API_KEY" not in gl.guidellm_env(None)


def test_cuda_packages_flags_a_resolution_that_pulls_cuda_torch() -> None:
    report = {"install": [{"metadata": {"name": n}} for n in ("torch", "nvidia-cublas", "rich")]}

    assert gl.cuda_packages(report) == ["nvidia-cublas"]
    assert gl.cuda_packages({"install": [{"metadata": {"name": "torch"}}]}) == []


def test_ensure_guidellm_returns_a_finished_venv_without_running_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "bin" / "guidellm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / ".installed").write_text("guidellm==0.8.1\n")
    _no_subprocess(monkeypatch)

    assert gl.ensure_guidellm(tmp_path, progress=lambda _: None) == exe


# -- llama-server -----------------------------------------------------------------------


def test_server_command_sizes_the_context_per_slot_and_uses_the_gguf_template() -> None:
    cmd = ls.server_command(
        Path("/b/llama-server"),
        Path("/m.gguf"),
        port=8081,
        num_slots=4,
        ctx_per_slot=1024,
        num_threads=3,
        alias="smol",
        extra_args=["--api-key", "k"],
    )

    def arg(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert cmd[0] == "/b/llama-server" and arg("-m") == "/m.gguf"
    assert (arg("--host"), arg("--port")) == ("127.0.0.1", "8081")
    assert (arg("-np"), arg("-c")) == ("4", "4096")
    assert arg("-t") == arg("-tb") == "3"
    assert "--cont-batching" in cmd and "--jinja" in cmd and "--chat-template" not in cmd
    assert arg("--alias") == "smol"
    assert cmd[-2:] == ["--api-key", "k"]


def test_llama_server_base_url_ends_in_v1_and_threads_follow_pinned_cpus(tmp_path: Path) -> None:
    server = ls.LlamaServer(Path("/b"), Path("/m.gguf"), log_dir=tmp_path, port=9, cpus=[0, 1])

    assert server.base_url == "http://127.0.0.1:9/v1"
    assert server.command[server.command.index("-t") + 1] == "2"
    assert server.log_path == tmp_path / "llama-server-9.log"
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.pid


def test_cpu_key_depends_on_model_and_flags_only() -> None:
    key = ls.cpu_key(CPUINFO)

    assert len(key) == 8 and int(key, 16) >= 0
    assert ls.cpu_key(CPUINFO.replace("2100.000", "3000.000")) == key
    assert ls.cpu_key(CPUINFO.replace("fpu sse sse2", "sse2 fpu sse")) == key
    assert ls.cpu_key(CPUINFO.replace(" avx512f", "")) != key
    assert ls.cpu_key(CPUINFO.replace("Xeon(R)", "EPYC")) != key
    assert ls.build_dir_name("0.3.36", key) == f"0.3.36-{key}"


def test_configure_command_builds_native_and_downloads_nothing() -> None:
    cmd = ls.configure_command(Path("/src"), Path("/build"))

    assert cmd[:5] == ["cmake", "-S", "/src", "-B", "/build"]
    for flag in (
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
    ):
        assert flag in cmd
    assert ls.build_command(Path("/build"), 2)[-4:] == ["--target", "llama-server", "-j", "2"]
    assert not any("amx" in part for part in cmd)


def test_a_cpu_with_amx_builds_without_it_in_a_directory_of_its_own() -> None:
    """ggml built natively on an AMX CPU ran `tilezero` before asking the kernel for AMX
    state and died with SIGILL; such a build passes -mno-amx-*, which GCC honours whatever
    -march=native says, and is cached apart from a build that had AMX."""
    cmd = ls.configure_command(Path("/src"), Path("/build"), no_amx=True)
    assert "-DGGML_NATIVE=ON" in cmd
    assert f"-DCMAKE_C_FLAGS={ls.NO_AMX_FLAGS}" in cmd
    assert f"-DCMAKE_CXX_FLAGS={ls.NO_AMX_FLAGS}" in cmd
    assert ls.NO_AMX_FLAGS.split() == ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert ls.build_dir_name("0.3.36", "abcd1234", True) == "0.3.36-abcd1234-noamx"
    assert ls.cpu_flags(CPUINFO.replace(" avx512f", " avx512f amx_tile")) >= {"amx_tile"}
    assert "amx_tile" not in ls.cpu_flags(CPUINFO)


def test_model_content_key_changes_when_a_file_is_rewritten(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    key = ls.model_content_key(tmp_path)

    assert ls.model_content_key(tmp_path) == key
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    assert ls.model_content_key(tmp_path) != key
    f32 = ls.gguf_cache_path(tmp_path / "cache", tmp_path, "f32")
    assert f32.name.endswith("-f32.gguf") and f32.name.startswith(tmp_path.name)
    assert ls.gguf_cache_path(tmp_path / "cache", tmp_path, "bf16") != f32


def test_convert_to_gguf_rejects_an_unknown_outtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outtype"):
        ls.convert_to_gguf(tmp_path, outtype="q4_0")


def test_ensure_llama_server_returns_a_finished_build_without_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = ls.build_dir_name(ls.LLAMA_CPP_PYTHON_VERSION, ls.host_cpu_key(), ls.host_has_amx())
    out = tmp_path / name
    binary = out / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (out / ".built").write_text("0.3.36\n")
    _no_subprocess(monkeypatch)

    assert ls.ensure_llama_server(tmp_path, progress=lambda _: None) == binary


def test_a_source_package_with_the_wrong_hash_is_refused_and_moved_aside(tmp_path: Path) -> None:
    version = ls.LLAMA_CPP_PYTHON_VERSION
    sdist = tmp_path / f"source-{version}" / f"llama_cpp_python-{version}.tar.gz"
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"not the pinned sdist")

    with pytest.raises(ls.LlamaServerError, match="sha256 mismatch") as err:
        ls.ensure_llama_cpp_source(tmp_path, progress=lambda _: None)

    assert err.value.step == "verify"
    assert not sdist.exists()
