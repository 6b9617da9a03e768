"""`switchyard bench slo`: the run. Our stack, then the baseline, the oracle's batch sizes
and llama-server, each behind the same open-loop levels; GuideLLM against our stack.

Every variant gets the same offered rates (multiples of the capacity our stack measured
first) and, per mix and level, the same arrivals and requests (one seed per level).
"""

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.slo.plan import MIXES, strictest, targets_from_config
from benchmarks.slo.report import all_checks, report, summary, write
from benchmarks.slo.run import Run, SloBenchOptions, progress
from benchmarks.slo.variants import run_baseline, run_llama, run_oracle, run_ours

DEFAULT_MODEL = "smollm2-135m-instruct"  # serve's PoolSection default
DEMO_MODELS = ("demo-small", "demo-large")


def resolve_model_dirs(doc: dict[str, Any], base_dir: Path, work_dir: Path) -> dict[str, Path]:
    """Each pool's checkpoint directory, fetched (or the demo ones made) now, so every
    stack starts on a directory and llama-server converts the same one."""
    from workers.models.fetch import fetch_model
    from workers.models.registry import find_model

    cache = Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")
    models_dir = doc.get("models_dir")
    models = (base_dir / Path(models_dir).expanduser()).resolve() if models_dir else None
    out: dict[str, Path] = {}
    for name, pool in (doc.get("pools") or {}).items():
        pool = pool or {}
        model = pool.get("model") or DEFAULT_MODEL
        if pool.get("model_dir"):
            out[name] = (base_dir / Path(pool["model_dir"]).expanduser()).resolve()
        elif model in DEMO_MODELS:
            demo = work_dir / "models"
            if not (demo / "small" / "config.json").is_file():
                from workers.models.demo import make_demo_checkpoints

                make_demo_checkpoints(demo, show_progress=False)
            out[name] = demo / model.removeprefix("demo-")
        else:
            out[name] = fetch_model(find_model(model), cache, models_dir=models).path
    return out


def run_slo_bench(opts: SloBenchOptions) -> dict[str, Any]:
    """The whole comparison; prints progress, the tables and the checks; returns the report
    (also written to `opts.out` after each variant)."""
    t0 = time.monotonic()
    say = progress(t0)
    config = Path(opts.config).expanduser().resolve()
    if not config.is_file():
        raise SystemExit(f"error: no config file at {config}")
    unknown = [m for m in opts.mixes if m not in MIXES]
    if unknown or not opts.mixes:
        raise SystemExit(f"error: unknown mix {unknown}; known: {', '.join(MIXES)}")
    original = yaml.safe_load(config.read_text()) or {}
    try:
        targets = targets_from_config(original)
    except ValueError as exc:
        raise SystemExit(f"error: {config}: {exc}") from None
    work_dir = Path(opts.work_dir or tempfile.mkdtemp(prefix="switchyard-bench-slo-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    shown = ", ".join(f"{p} TTFT {t.ttft_s:g} s ITL {t.itl_s:g} s" for p, t in targets.items())
    say(f"config {config}; targets {shown}")
    say(f"work dir {work_dir} (stack configs and logs, GuideLLM's report)")
    model_dirs = resolve_model_dirs(original, config.parent, work_dir)
    run = Run(opts, original, config.parent, model_dirs, targets, strictest(targets), work_dir, say)
    run_ours(run)
    write(run)
    steps: list[tuple[str, str, Callable[[Run], None]]] = [
        ("baseline", "baseline", run_baseline),
        ("oracle", "oracle", run_oracle),
        ("llama", "llama-server", run_llama),
    ]
    for key, variant, step in steps:
        if key in opts.skip:
            continue
        try:
            step(run)
        except Exception as exc:  # a variant that fails leaves the rest of the comparison
            run.errors[variant] = repr(exc)
            say(f"{variant} failed: {exc!r}")
        write(run)
    checks = all_checks(run)
    write(run, checks)
    print("\n" + summary(run, checks), flush=True)
    say(f"done in {time.monotonic() - t0:.0f} s" + (f"; report {opts.out}" if opts.out else ""))
    return report(run, checks)
