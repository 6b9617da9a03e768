"""`switchyard bench autoscale`: the autoscaler against baselines and oracles, in
simulation (benchmarks/autoscale/simulate.py): a burst, a diurnal ramp, and a spike shorter
than a replica's start-up, each replayed with the same arrivals for every policy; then the
autoscaler on the burst and the ramp with some 2,000-token answers, its drained replicas
waiting for their longest stream or handing it over after the workers' drain grace."""

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
    bar = tqdm(total=len(traces) * 6 + len(DRAIN_TRACES) * 2, desc="autoscale sim", unit="run")
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
    data["drain"] = _drain_runs(traces, sim, bar)
    bar.close()
    data["targets"] = _targets(data)
    md = _markdown(data, sim)
    json_path, md_path = write_report(opts.out_dir, "autoscale", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data


# The drain comparison: these traces with LONG_SHARE of long answers, and this grace.
DRAIN_TRACES = (0, 1)  # burst, diurnal
LONG_SHARE = 0.02
DRAIN_GRACE_S = 10.0  # the worker's default `drain_grace_s`


def _long(sim: SimConfig) -> SimConfig:
    return dataclasses.replace(sim, long_share=LONG_SHARE)


def _scaled(trace: Trace, scale: float) -> Trace:
    return Trace(trace.name, trace.duration_s, lambda t: scale * trace.rate_per_s(t))


def _drain_runs(traces: list[Trace], sim: SimConfig, bar: tqdm) -> dict[str, Any]:
    """The autoscaler with long answers in the mix, drained replicas waiting for their
    longest stream against handing it over after the grace; the same arrivals for both."""
    out: dict[str, Any] = {}
    long_sim = _long(sim)
    # The same slots' demand as the trace without long answers: its rates scaled down.
    scale = sim.mean_request_s / long_sim.mean_request_s
    for base in (traces[k] for k in DRAIN_TRACES):
        trace = _scaled(base, scale)
        arrivals = make_arrivals(trace, long_sim)
        rows = {}
        for label, grace in (
            ("waits for its streams", None),
            (f"grace {DRAIN_GRACE_S:g} s", DRAIN_GRACE_S),
        ):
            cfg = dataclasses.replace(long_sim, drain_grace_s=grace)
            policy = Autoscaler({trace.name: autoscaler_config(cfg)}).decide
            res = simulate(policy, trace, cfg, arrivals)
            rows[label] = {
                **summarize(res, cfg),
                "drains": len(res.drain_s),
                "drain_p50_s": percentile(res.drain_s, 50),
                "drain_max_s": max(res.drain_s, default=math.nan),
                "handed_over": res.handed_over,
                "resume_stall_p99_s": percentile(res.resume_stall_s, 99),
            }
            bar.update()
        wait, grace_row = rows.values()
        grace_row["vs_waiting"] = grace_row["replica_seconds"] / wait["replica_seconds"]
        wait["vs_waiting"] = 1.0
        out[trace.name] = rows
    return out


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
    for name, rows in data["drain"].items():
        wait, grace = rows.values()
        out[f"drain: {name}"] = {
            "fewer_replica_seconds_with_the_grace": grace["vs_waiting"] < 1.0,
            "every_drain_within_grace_plus_1s": grace["drain_max_s"] <= DRAIN_GRACE_S + 1.0,
            "no_stream_cut": wait["stream_cuts"] == grace["stream_cuts"] == 0,
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


DRAIN_COLUMNS = [
    ("drain", "drained replica"),
    ("replica_seconds", "replica-s"),
    ("vs_waiting", "x waiting"),
    ("drains", "drains"),
    ("drain_p50_s", "drain p50 s"),
    ("drain_max_s", "drain max s"),
    ("handed_over", "handed over"),
    ("resume_stall_p99_s", "resume stall p99 s"),
    ("ttft_slo_attainment", "TTFT SLO"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("refused", "refused"),
    ("stream_cuts", "cuts"),
]


def _section(
    rows: dict[str, dict[str, Any]],
    label: str,
    columns: list[tuple[str, str]],
    title: str,
    verdict: dict[str, bool],
) -> list[str]:
    """One trace's table (a row per `label`) and its targets' verdict."""
    table = [{label: k, **v} for k, v in rows.items()]
    for row in table:
        row["ttft_slo_attainment"] = f"{100 * row['ttft_slo_attainment']:.1f}%"
    met = ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in verdict.items())
    return [markdown_table(table, columns) + "\n", f"{title}: {met}\n"]


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
        parts += _section(rows, "policy", COLUMNS, "Targets (autoscaler)", data["targets"][name])
    parts.append(
        "## Drain: waiting for the longest stream, or handing it over\n\n"
        f"The autoscaler again, {100 * LONG_SHARE:g}% of requests now long answers "
        f"(U(0.5, 1.5) x {sim.long_service_s:.0f} s, about 2,000 tokens) and the rates "
        f"scaled by {sim.mean_service_s / _long(sim).mean_request_s:.2f} so the slots' "
        "demand is the trace's; the same arrivals both ways. A drained replica either waits "
        "for its last stream, or hands the streams it still holds after "
        f"{DRAIN_GRACE_S:g} s to another replica ({sim.resume_s:g} s resume each) and exits. "
        "A draining replica counts against max_replicas and in the replica-seconds until it "
        "exits.\n"
    )
    for name, rows in data["drain"].items():
        parts.append(f"### {name}, {100 * LONG_SHARE:g}% long answers\n")
        parts += _section(
            rows, "drain", DRAIN_COLUMNS, "Targets", data["targets"][f"drain: {name}"]
        )
    return "\n".join(parts)
