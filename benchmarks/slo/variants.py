"""The variants, each behind the same levels: our stack (and GuideLLM against it), the
baseline, the oracle's batch sizes, llama-server."""

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadOptions, LoadStats, run_load
from benchmarks.slo.capacity import measure_capacity
from benchmarks.slo.levels import LevelResult, summarise_level
from benchmarks.slo.plan import MIXES, level_seed, plan_levels, stack_doc
from benchmarks.slo.report import error_statuses
from benchmarks.slo.run import Run
from benchmarks.slo.stack import FleetWatch, ServeStack, tenant_keys
from benchmarks.slo.tables import level_line
from benchmarks.slo.verdict import select_oracle


def sweep(
    run: Run,
    variant: str,
    base_url: str,
    keys: list[str],
    *,
    watch: FleetWatch | None,
    duration_s: float,
    model: str | None = None,
    keepalive: bool = True,
    note: str = "",
) -> dict[str, list[LevelResult]]:
    """Every mix's levels against `base_url`, in order; returns the results per mix."""
    out: dict[str, list[LevelResult]] = {}
    for mi, name in enumerate(run.opts.mixes):
        mix = MIXES[name]
        for li, level in enumerate(run.levels.get(name, [])):
            label = f"{name}@{level.factor:g}"
            opts = LoadOptions(
                base_url=base_url,
                keys=keys,
                rate_per_s=level.rate_per_s,
                duration_s=duration_s,
                mix=mix.kinds,
                weights=mix.weights,
                model=model or mix.model,
                seed=level_seed(run.opts.seed, mi, li),
                keepalive=keepalive,
            )
            stats = LoadStats()
            if watch is not None:
                watch.label = label
            run.say(f"{variant}{' ' + note if note else ''} {label}: {level.rate_per_s:.2f}/s")
            elapsed = asyncio.run(run_load(opts, stats, _ticker(run, stats, duration_s)))
            if watch is not None:
                watch.label = "idle"
            r = summarise_level(
                variant,
                name,
                level,
                stats.outcomes,
                duration_s=duration_s,
                elapsed_s=elapsed,
                targets=run.targets,
                default=run.default,
                itl_rule=run.opts.itl_rule,
                fleet_samples=watch.labelled(label) if watch is not None else None,
            )
            r.note = note
            run.say("  " + level_line(r))
            out.setdefault(name, []).append(r)
            if variant != "oracle":
                run.keep(variant, r, [asdict(o) for o in stats.outcomes])
            time.sleep(run.opts.settle_s)
    return out


def _ticker(run: Run, stats: LoadStats, duration_s: float) -> Callable[[float], None]:
    """Every 10 s of a level: where it is (a level past its arrivals is draining)."""
    state = {"next": 10.0}

    def tick(t: float) -> None:
        if t >= state["next"]:
            state["next"] += 10.0
            phase = "arrivals" if t < duration_s else "draining"
            run.say(
                f"    t={t:.0f} s ({phase}): {len(stats.outcomes)} sent, {stats.inflight} in flight"
            )

    return tick


def _stack(run: Run, variant: str, **kw: Any) -> ServeStack:
    run_dir = run.work_dir / variant
    run.say(f"{variant}: starting switchyard serve (log {run_dir / 'serve.log'})")

    def make(port: int) -> dict:
        return stack_doc(
            run.original,
            run.base_dir,
            data_dir=run_dir / "data",
            port=port,
            model_dirs=run.model_dirs,
            **kw,
        )

    return ServeStack(make, run_dir, say=run.say)


def run_ours(run: Run) -> None:
    """Our stack as configured: capacity per mix, the sweep, then GuideLLM beside it."""
    with _stack(run, "switchyard") as stack, stack.admin() as adm:
        keys = tenant_keys(adm, run.opts.tenants)
        with FleetWatch(stack) as watch:
            run.fleet["switchyard"] = watch.samples  # kept even if the sweep fails
            for mi, name in enumerate(run.opts.mixes):
                if run.opts.capacity_per_s is not None:
                    cap = run.opts.capacity_per_s
                    run.capacity[name] = {"requests_per_s": cap, "given": True}
                else:
                    watch.label = f"capacity:{name}"
                    run.say(
                        f"capacity of {name}: closed loop, {run.opts.capacity_concurrency} "
                        f"streams, 3 s warm-up + {run.opts.capacity_s:g} s counted"
                    )
                    c = asyncio.run(
                        measure_capacity(
                            f"{stack.url}/v1",
                            keys,
                            MIXES[name],
                            concurrency=run.opts.capacity_concurrency,
                            window_s=run.opts.capacity_s,
                            seed=level_seed(run.opts.seed, mi, 999),
                        )
                    )
                    watch.label = "idle"
                    cap = c.requests_per_s
                    run.capacity[name] = asdict(c)
                    run.say(
                        f"  capacity {name}: {cap:.2f} requests/s ({c.num_ok} ok, "
                        f"{c.num_refused} refused, {c.num_failed} failed)"
                    )
                    time.sleep(run.opts.settle_s)
                try:
                    run.levels[name] = plan_levels(cap, run.opts.factors)
                except ValueError as exc:
                    run.errors[f"mix {name}"] = str(exc)
                    run.say(f"  mix {name} skipped: {exc}")
            sweep(
                run,
                "switchyard",
                f"{stack.url}/v1",
                keys,
                watch=watch,
                duration_s=run.opts.duration_s,
            )
            if "guidellm" not in run.opts.skip:
                watch.label = "guidellm"
                run.guidellm = run_guidellm_beside(run, stack.url, keys[0])


def run_guidellm_beside(run: Run, url: str, key: str) -> dict:
    from benchmarks.peers.guidellm import GuideLLMError, run_guidellm

    try:
        levels = run_guidellm(
            f"{url}/v1",
            "auto",
            llama_model_dir(run),
            profile="sweep",
            rate=run.opts.guidellm_levels,
            max_seconds=run.opts.duration_s,
            data=run.opts.guidellm_data,
            out_dir=run.work_dir / "guidellm",
            max_concurrency=16,
            api_key=key,
            max_worker_processes=1,
            progress=run.say,
        )
    except (GuideLLMError, OSError) as exc:
        run.say(f"guidellm failed: {exc}")
        return {"error": str(exc)}
    report_path = run.work_dir / "guidellm" / "report.json"
    return {
        "levels": [asdict(lv) | {"label": lv.label} for lv in levels],
        "num_errored": sum(lv.num_errored for lv in levels),
        "error_statuses": error_statuses(json.loads(report_path.read_text())),
        "data": run.opts.guidellm_data,
        "report": str(report_path),
    }


def run_baseline(run: Run) -> None:
    """The same stack without its latency targets: today's admission."""
    with (
        _stack(run, "baseline", with_targets=False) as stack,
        stack.admin() as adm,
    ):
        keys = tenant_keys(adm, run.opts.tenants)
        with FleetWatch(stack) as watch:
            run.fleet["baseline"] = watch.samples  # kept even if the sweep fails
            sweep(
                run,
                "baseline",
                f"{stack.url}/v1",
                keys,
                watch=watch,
                duration_s=run.opts.duration_s,
            )


def run_oracle(run: Run) -> None:
    """No targets, a static max_num_seqs per stack; the best per level is the oracle."""
    duration = run.opts.oracle_duration_s or run.opts.duration_s / 2
    for seqs in run.opts.oracle_seqs:
        variant = f"oracle-{seqs}"
        try:
            with (
                _stack(
                    run,
                    variant,
                    with_targets=False,
                    max_num_seqs=seqs,
                ) as stack,
                stack.admin() as adm,
            ):
                keys = tenant_keys(adm, run.opts.tenants)
                with FleetWatch(stack) as watch:
                    run.fleet[variant] = watch.samples  # kept even if the sweep fails
                    run.by_seqs[seqs] = sweep(
                        run,
                        "oracle",
                        f"{stack.url}/v1",
                        keys,
                        watch=watch,
                        duration_s=duration,
                        note=f"max_num_seqs={seqs}",
                    )
        except Exception as exc:  # one batch size failing leaves the others
            run.errors[variant] = repr(exc)
            run.say(f"{variant} failed: {exc}")
    for name in run.opts.mixes:
        per = {s: r[name] for s, r in run.by_seqs.items() if name in r}
        if per:
            run.results.setdefault("oracle", {})[name] = select_oracle(per)


def llama_model_dir(run: Run) -> Path:
    """The small pool's checkpoint (the cascade's small pool, else the first)."""
    small = (run.original.get("cascade") or {}).get("small_pool") or "small"
    return run.model_dirs.get(small) or next(iter(run.model_dirs.values()))


def run_llama(run: Run) -> None:
    from benchmarks.peers.llama_server import LlamaServer, convert_to_gguf, ensure_llama_server

    binary = ensure_llama_server(progress=run.say)
    gguf = convert_to_gguf(llama_model_dir(run), progress=run.say)
    log_dir = run.work_dir / "llama-server"
    run.say(f"llama-server: {run.opts.llama_slots} slots, {run.opts.llama_threads} threads, {gguf}")
    with LlamaServer(
        binary,
        gguf,
        log_dir=log_dir,
        num_slots=run.opts.llama_slots,
        num_threads=run.opts.llama_threads,
    ) as server:
        keys = ["no-key"] * run.opts.tenants  # llama-server runs without --api-key
        sweep(
            run,
            "llama-server",
            server.base_url,
            keys,
            watch=None,
            duration_s=run.opts.duration_s,
            model="smollm2",
            keepalive=False,
        )
