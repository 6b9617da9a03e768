"""`switchyard bench autoscale`: the autoscaler against baselines and oracles, in
simulation (benchmarks/autoscale/simulate.py): a burst, a diurnal ramp, and a spike shorter
than a replica's start-up, each replayed with the same arrivals for every policy."""

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.autoscale.baselines import HpaRatioPolicy, oracle_policy, static_policy
from benchmarks.autoscale.simulate import (
    Policy,
    SimConfig,
    SimResult,
    Trace,
    make_arrivals,
    simulate,
)
from benchmarks.stats import markdown_table, percentile, write_report
from workers.fleet.autoscaler import Autoscaler, AutoscalerConfig


@dataclass
class AutoscaleBenchOptions:
    out_dir: Path
    quick: bool = False
    seed: int = 0


def bench_traces(quick: bool = False) -> list[Trace]:
    """Rates in requests/s; with the default SimConfig one replica serves 2 req/s."""
    scale = 0.25 if quick else 1.0

    def burst(t: float) -> float:
        return 23.0 if 300 * scale <= t < 900 * scale else 4.0

    def diurnal(t: float) -> float:
        return 2.0 + 13.0 * (1 - math.cos(2 * math.pi * t / (3600 * scale)))

    def spike(t: float) -> float:
        return 20.0 if 300 * scale <= t < 300 * scale + 20 else 4.0

    return [
        Trace("burst 4 -> 23 req/s for 600 s", 1800 * scale, burst),
        Trace("diurnal 2..28 req/s over 3600 s", 3600 * scale, diurnal),
        Trace("spike 20 req/s for 20 s (< start-up)", 900 * scale, spike),
    ]


def autoscaler_config(sim: SimConfig) -> AutoscalerConfig:
    return AutoscalerConfig(
        min_replicas=sim.min_replicas,
        max_replicas=sim.max_replicas,
        target_running_per_replica=sim.capacity_per_replica * sim.target_utilization,
        ttft_slo_s=sim.ttft_slo_s,
    )


def policies(trace: Trace, sim: SimConfig) -> dict[str, tuple[Policy, SimConfig]]:
    """Each policy with the simulator configuration it runs under."""
    instant = dataclasses.replace(sim, startup_s=0.0)
    return {
        "autoscaler": (Autoscaler({trace.name: autoscaler_config(sim)}).decide, sim),
        "static-min": (static_policy(sim.min_replicas), sim),
        "static-max": (static_policy(sim.max_replicas), sim),
        "hpa-ratio": (HpaRatioPolicy(sim), sim),
        "oracle-instant": (oracle_policy(trace, instant, lead_s=0.0), instant),
        "oracle-lead": (oracle_policy(trace, sim, lead_s=sim.startup_s), sim),
    }


def summarize(res: SimResult, sim: SimConfig) -> dict[str, Any]:
    met = sum(1 for x in res.ttft_s if x <= sim.ttft_slo_s)
    return {
        "offered": res.offered,
        "served": res.served,
        "refused": res.refused,
        "refused_below_max": res.refused_below_max,
        "stream_cuts": res.stream_cuts,
        "replica_seconds": res.replica_seconds,
        "peak_ordered": res.peak_ordered,
        "peak_needed": res.peak_needed,
        "overshoot": res.peak_ordered - res.peak_needed,
        "time_to_capacity_s": res.time_to_capacity_s,
        "flaps": res.flaps,
        # Refused requests count as misses.
        "ttft_slo_attainment": met / res.offered if res.offered else math.nan,
        "ttft_p50_s": percentile(res.ttft_s, 50),
        "ttft_p99_s": percentile(res.ttft_s, 99),
        "decisions": [d.to_dict() for d in res.decisions[:200]],
    }


def run_autoscale_bench(opts: AutoscaleBenchOptions) -> dict[str, Any]:
    sim = SimConfig(seed=opts.seed)
    data: dict[str, Any] = {"sim": dataclasses.asdict(sim), "quick": opts.quick, "traces": {}}
    traces = bench_traces(opts.quick)
    bar = tqdm(total=len(traces) * 6, desc="autoscale sim", unit="run")
    for trace in traces:
        arrivals = make_arrivals(trace, sim)
        rows: dict[str, dict[str, Any]] = {}
        for name, (policy, cfg) in policies(trace, sim).items():
            rows[name] = summarize(simulate(policy, trace, cfg, arrivals), cfg)
            bar.update()
        for row in rows.values():
            row["vs_instant"] = row["replica_seconds"] / rows["oracle-instant"]["replica_seconds"]
            row["vs_lead"] = row["replica_seconds"] / rows["oracle-lead"]["replica_seconds"]
        data["traces"][trace.name] = rows
    bar.close()
    data["targets"] = _targets(data)
    md = _markdown(data, sim)
    json_path, md_path = write_report(opts.out_dir, "autoscale", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def _targets(data: dict[str, Any]) -> dict[str, dict[str, bool]]:
    out = {}
    for name, rows in data["traces"].items():
        a = rows["autoscaler"]
        out[name] = {
            "no_refusal_below_max": a["refused_below_max"] == 0,
            "replica_seconds_le_1.3x_lead": a["vs_lead"] <= 1.3,
            "overshoot_le_1": a["overshoot"] <= 1,
            "no_stream_cut": a["stream_cuts"] == 0,
        }
    return out


COLUMNS = [
    ("policy", "policy"),
    ("replica_seconds", "replica-s"),
    ("vs_instant", "x instant"),
    ("vs_lead", "x lead"),
    ("peak_ordered", "peak ordered"),
    ("peak_needed", "needed"),
    ("flaps", "flaps"),
    ("time_to_capacity_s", "to capacity s"),
    ("ttft_slo_attainment", "TTFT SLO"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("refused", "refused"),
    ("refused_below_max", "refused < max"),
    ("stream_cuts", "cuts"),
]


def _markdown(data: dict[str, Any], sim: SimConfig) -> str:
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if data["quick"] else []
    parts.append(
        f"Simulated pool: {sim.capacity_per_replica} slots per replica, {sim.startup_s:.0f} s "
        f"start-up, {sim.mean_service_s:.0f} s mean service, queue {sim.queue_capacity}, "
        f"TTFT SLO {sim.ttft_slo_s:.0f} s, {sim.min_replicas}..{sim.max_replicas} replicas, "
        f"seed {sim.seed}.\n"
    )
    for name, rows in data["traces"].items():
        parts.append(f"### {name}\n")
        table = [{"policy": k, **v} for k, v in rows.items()]
        for row in table:
            row["ttft_slo_attainment"] = f"{100 * row['ttft_slo_attainment']:.1f}%"
        parts.append(markdown_table(table, COLUMNS) + "\n")
        verdict = data["targets"][name]
        parts.append(
            "Targets (autoscaler): "
            + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in verdict.items())
            + "\n"
        )
    return "\n".join(parts)
