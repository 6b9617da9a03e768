"""GuideLLM as a benchmark peer: installed into its own virtual environment, run against an
OpenAI-compatible base URL, its JSON report reduced to one row per rate level.

GuideLLM 0.8.1 depends on torch directly. pip would resolve that to a CUDA build with
several GB of nvidia-* wheels, so the install is constrained to ``torch==2.13.0`` and
refused (before anything is installed) if the resolution still pulls CUDA packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import venv
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GUIDELLM_VERSION = "0.8.1"
TORCH_CONSTRAINT = "torch==2.13.0"
# Packages whose presence in the resolution means pip chose a CUDA torch.
_CUDA_PREFIXES = ("nvidia-", "cuda-", "triton")

Progress = Callable[[str], None]


class GuideLLMError(RuntimeError):
    """Installing or running GuideLLM failed; `log_path` holds its output when there is one."""

    def __init__(self, step: str, message: str, log_path: Path | None = None) -> None:
        super().__init__(f"guidellm {step}: {message}")
        self.step = step
        self.log_path = log_path


def default_venv_dir() -> Path:
    return Path.home() / ".cache" / "switchyard" / "peers" / f"guidellm-{GUIDELLM_VERSION}"


def cuda_packages(pip_report: Mapping[str, Any]) -> list[str]:
    """Names in a ``pip install --report`` resolution that come with a CUDA torch."""
    names = [str(item["metadata"]["name"]).lower() for item in pip_report.get("install", [])]
    return sorted(n for n in names if n.startswith(_CUDA_PREFIXES))


def ensure_guidellm(cache_dir: Path | None = None, progress: Progress = print) -> Path:
    """The `guidellm` executable of a venv holding ``guidellm==0.8.1`` (and CPU torch).

    `cache_dir` is the venv's directory (default
    ``~/.cache/switchyard/peers/guidellm-0.8.1``). A finished venv returns at once.
    """
    venv_dir = cache_dir or default_venv_dir()
    exe = venv_dir / "bin" / "guidellm"
    stamp = venv_dir / ".installed"
    if stamp.exists() and os.access(exe, os.X_OK):
        return exe
    t0 = time.monotonic()
    if venv_dir.exists():
        shutil.rmtree(venv_dir)  # a half-made venv from an interrupted install
    progress(f"guidellm: creating venv {venv_dir}")
    venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    py = venv_dir / "bin" / "python"
    constraints = venv_dir / "constraints.txt"
    constraints.write_text(TORCH_CONSTRAINT + "\n")
    log_path = venv_dir / "install.log"
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints)]
    spec = f"guidellm=={GUIDELLM_VERSION}"
    report = venv_dir / "resolution.json"
    progress(f"guidellm: resolving {spec} with {TORCH_CONSTRAINT}")
    _run(pip + ["--dry-run", "--quiet", "--report", str(report), spec], log_path, "resolve")
    cuda = cuda_packages(json.loads(report.read_text()))
    if cuda:
        raise GuideLLMError(
            "resolve",
            f"{TORCH_CONSTRAINT} resolves to a CUDA build here (would pull {', '.join(cuda)});"
            " make a CPU torch wheel available to pip (e.g. a find-links dir) and retry",
            log_path,
        )
    progress(f"guidellm: installing {spec} (log {log_path})")
    _run(pip + [spec], log_path, "install")
    if not os.access(exe, os.X_OK):
        raise GuideLLMError("install", f"installed but {exe} is missing", log_path)
    stamp.write_text(spec + "\n")
    progress(f"guidellm: installed in {time.monotonic() - t0:.0f} s -> {exe}")
    return exe


def _run(cmd: Sequence[str], log_path: Path, step: str) -> None:
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(list(cmd), stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_path.read_text()[-3000:]
        raise GuideLLMError(step, f"exit status {rc}; see {log_path}\n{tail}", log_path)


# -- the run ------------------------------------------------------------------------------

PROFILES = ("sweep", "synchronous", "throughput", "constant", "poisson", "concurrent")


def parse_data_spec(spec: str) -> dict[str, Any]:
    """``"prompt_tokens=256,output_tokens=64"`` as a GuideLLM synthetic-text data source.

    Values are ints where they parse as ints; ``kind=...`` picks another source kind.
    """
    data: dict[str, Any] = {"kind": "synthetic_text"}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"data spec item {part!r} is not key=value")
        try:
            data[key.strip()] = int(value)
        except ValueError:
            data[key.strip()] = value.strip()
    return data


def profile_args(
    profile: str,
    rate: float | Sequence[float] | None = None,
    max_concurrency: int | None = None,
) -> dict[str, Any]:
    """GuideLLM's profile config for `profile` and `rate`.

    `rate` means: for ``sweep`` the number of levels (synchronous and throughput count;
    default 10, at least 2); for ``constant``/``poisson`` the request rates in req/s; for
    ``concurrent`` the stream counts; unused for ``synchronous`` and ``throughput``.
    `max_concurrency` caps requests in flight (sweep, throughput, constant, poisson).
    """
    rates = [] if rate is None else [rate] if isinstance(rate, int | float) else list(rate)
    args: dict[str, Any] = {"kind": profile}
    if profile == "sweep":
        size = int(rates[0]) if rates else 10
        if size < 2:
            raise ValueError("a sweep has at least 2 levels (synchronous and throughput)")
        args["sweep_size"] = size
    elif profile in ("constant", "poisson"):
        if not rates:
            raise ValueError(f"profile {profile!r} needs rate (requests per second)")
        args["rate"] = [float(r) for r in rates]
    elif profile == "concurrent":
        if not rates:
            raise ValueError("profile 'concurrent' needs rate (the stream counts)")
        args["streams"] = [int(r) for r in rates]
    elif profile not in ("synchronous", "throughput"):
        raise ValueError(f"profile must be one of {PROFILES}, not {profile!r}")
    if max_concurrency is not None and profile in ("sweep", "throughput", "constant", "poisson"):
        args["max_concurrency"] = max_concurrency
    elif profile == "throughput":
        args["max_concurrency"] = None
    return args


def build_scenario(
    target: str,
    model: str,
    processor: Path,
    *,
    profile: dict[str, Any],
    max_seconds: float,
    data: dict[str, Any],
    report_path: Path,
    max_requests: int | None = None,
    warmup_s: float = 0.0,
    cooldown_s: float = 0.0,
    request_timeout_s: float | None = None,
) -> dict[str, Any]:
    """The scenario file GuideLLM 0.8.1 reads with ``--scenario``: no secrets in it (the
    API key goes in the environment, see `guidellm_env`)."""
    constraints: list[dict[str, Any]] = [{"kind": "max_duration", "seconds": max_seconds}]
    if max_requests is not None:
        constraints.append({"kind": "max_requests", "count": max_requests})
    backend: dict[str, Any] = {"kind": "openai_http", "target": target, "model": model}
    if request_timeout_s is not None:
        backend["timeout"] = request_timeout_s
    profile = dict(profile)
    if warmup_s:
        profile["warmup"] = {"mode": "duration", "value": warmup_s}
    if cooldown_s:
        profile["cooldown"] = {"mode": "duration", "value": cooldown_s}
    return {
        "spec": {
            "backend": backend,
            "profile": profile,
            "constraints": constraints,
            "tokenizer": {"kind": "huggingface_auto", "model": str(processor)},
            "data": [data],
            "outputs": [{"kind": "json", "path": str(report_path)}],
        }
    }


def guidellm_env(
    api_key: str | None = None, max_worker_processes: int | None = None
) -> dict[str, str]:
    """Environment for a GuideLLM run: offline for the hub, and the bearer key.

    GuideLLM reads ``GUIDELLM__SPEC__BACKEND__API_KEY`` into the backend's ``api_key`` and
    sends ``Authorization: Bearer <key>``; the report shows it masked. Passing it this way
    keeps it off the command line and out of the scenario file.
    """
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if api_key:
        env["GUIDELLM__SPEC__BACKEND__API_KEY"] = api_key
    if max_worker_processes is not None:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(max_worker_processes)
    return env


def run_guidellm(
    target: str,
    model: str,
    processor: Path,
    *,
    profile: str = "sweep",
    max_seconds: float,
    data: str,
    out_dir: Path,
    rate: float | Sequence[float] | None = None,
    max_concurrency: int | None = None,
    max_requests: int | None = None,
    api_key: str | None = None,
    warmup_s: float = 0.0,
    cooldown_s: float = 0.0,
    max_worker_processes: int | None = None,
    cpus: Sequence[int] | None = None,
    guidellm: Path | None = None,
    timeout_s: float | None = None,
    progress: Progress = print,
) -> list[GuideLLMLevel]:
    """Runs ``guidellm run`` against the OpenAI-compatible `target` and parses its report.

    `target` is a base URL (``http://host:port/v1``; GuideLLM strips ``/v1`` and checks
    ``GET /health`` on what is left). `processor` is a local tokenizer directory. Each
    level runs at most `max_seconds`. `data` is a synthetic spec (see `parse_data_spec`);
    `rate` is read by profile (see `profile_args`). Writes ``scenario.json``,
    ``report.json`` and ``guidellm.log`` under `out_dir`. `cpus` pins GuideLLM's processes.
    `timeout_s` bounds the whole run (default: generous for the number of levels).
    """
    exe = guidellm or ensure_guidellm(progress=progress)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "report.json"
    report_path.unlink(missing_ok=True)
    scenario = build_scenario(
        target,
        model,
        Path(processor).expanduser().resolve(),
        profile=profile_args(profile, rate, max_concurrency),
        max_seconds=max_seconds,
        data=parse_data_spec(data),
        report_path=report_path,
        max_requests=max_requests,
        warmup_s=warmup_s,
        cooldown_s=cooldown_s,
    )
    scenario_path = out_dir / "scenario.json"
    scenario_path.write_text(json.dumps(scenario, indent=2) + "\n")
    cmd = [str(exe), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]
    env = {**os.environ, **guidellm_env(api_key, max_worker_processes)}
    num_levels = len(_levels_hint(scenario["spec"]["profile"]))
    limit_s = timeout_s or 120.0 + num_levels * (max_seconds + warmup_s + cooldown_s + 60.0)
    log_path = out_dir / "guidellm.log"
    progress(f"guidellm: {profile} against {target}, up to {num_levels} level(s) (log {log_path})")
    t0 = time.monotonic()
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(
                cmd,
                env=env,
                cwd=out_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=limit_s,
                preexec_fn=pin,
            ).returncode
        except subprocess.TimeoutExpired as exc:
            raise GuideLLMError("run", f"no result after {limit_s:.0f} s", log_path) from exc
    if rc != 0 or not report_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise GuideLLMError("run", f"exit status {rc}; see {log_path}\n{tail}", log_path)
    progress(f"guidellm: done in {time.monotonic() - t0:.0f} s -> {report_path}")
    return load_report(report_path)


def _levels_hint(profile: Mapping[str, Any]) -> list[object]:
    kind = profile["kind"]
    if kind == "sweep":
        return list(range(int(profile["sweep_size"])))
    if kind in ("constant", "poisson"):
        return list(profile["rate"])
    if kind == "concurrent":
        return list(profile["streams"])
    return [kind]


# -- the report ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GuideLLMLevel:
    """One rate level of a GuideLLM report. Latencies are over successful requests."""

    strategy: str  # synchronous, throughput, constant, poisson, concurrent
    target_rate: float | None  # req/s the level aimed at (constant, poisson); else None
    concurrency: int | None  # streams (concurrent), cap (throughput), 1 (synchronous)
    duration_s: float  # the measured window
    requests_per_s: float  # successful requests completed per second
    num_successful: int
    num_errored: int
    num_incomplete: int  # cut off by the level's end
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    output_tokens_per_s: float  # all requests' output tokens, incomplete ones included

    @property
    def label(self) -> str:
        if self.target_rate is not None:
            return f"{self.strategy}@{self.target_rate:g}"
        if self.concurrency is not None and self.strategy != "synchronous":
            return f"{self.strategy}@{self.concurrency}"
        return self.strategy


def _stat(metric: Mapping[str, Any], key: str, *, group: str = "successful") -> float | None:
    dist = metric.get(group) or {}
    if not dist.get("count"):
        return None
    value = dist["percentiles"][key] if key.startswith("p") else dist[key]
    return None if value is None else float(value)


def parse_level(benchmark: Mapping[str, Any]) -> GuideLLMLevel:
    strategy = benchmark["config"]["strategy"]
    kind = str(strategy["type_"])
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    rate = strategy.get("rate")
    concurrency = strategy.get("streams") or strategy.get("max_concurrency")
    return GuideLLMLevel(
        strategy=kind,
        target_rate=float(rate) if rate is not None else None,
        concurrency=int(concurrency) if concurrency is not None else None,
        duration_s=float(benchmark["duration"]),
        requests_per_s=_stat(metrics["requests_per_second"], "mean") or 0.0,
        num_successful=int(totals["successful"]),
        num_errored=int(totals["errored"]),
        num_incomplete=int(totals["incomplete"]),
        ttft_p50_ms=_stat(metrics["time_to_first_token_ms"], "p50"),
        ttft_p99_ms=_stat(metrics["time_to_first_token_ms"], "p99"),
        itl_p50_ms=_stat(metrics["inter_token_latency_ms"], "p50"),
        itl_p99_ms=_stat(metrics["inter_token_latency_ms"], "p99"),
        output_tokens_per_s=_stat(metrics["output_tokens_per_second"], "mean", group="total")
        or 0.0,
    )


def parse_report(report: Mapping[str, Any]) -> list[GuideLLMLevel]:
    """The levels of a GuideLLM 0.8.x JSON report (``benchmarks`` in run order)."""
    benchmarks = report.get("benchmarks")
    if not isinstance(benchmarks, list):
        raise GuideLLMError("parse", "report has no 'benchmarks' list")
    return [parse_level(b) for b in benchmarks]


def load_report(path: Path) -> list[GuideLLMLevel]:
    return parse_report(json.loads(Path(path).read_text()))


def format_table(levels: Sequence[GuideLLMLevel]) -> str:
    """A fixed-width table, one row per level."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    header = (
        f"{'level':<18} {'req/s':>7} {'ok':>5} {'err':>4} {'inc':>4} {'ttft p50':>9}"
        f" {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'out tok/s':>9}"
    )
    rows = [header, "-" * len(header)]
    for lv in levels:
        rows.append(
            f"{lv.label:<18} {lv.requests_per_s:>7.2f} {lv.num_successful:>5}"
            f" {lv.num_errored:>4} {lv.num_incomplete:>4} {ms(lv.ttft_p50_ms):>9}"
            f" {ms(lv.ttft_p99_ms):>9} {ms(lv.itl_p50_ms):>8} {ms(lv.itl_p99_ms):>8}"
            f" {lv.output_tokens_per_s:>9.1f}"
        )
    return "\n".join(rows)
