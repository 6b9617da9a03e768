"""`switchyard admin fleet`: GET /admin/fleet as a readable table."""

from typing import Any


def render_fleet(doc: dict[str, Any]) -> str:
    lines = []
    for name, pool in doc.items():
        bounds = ""
        if pool.get("min_replicas") is not None:
            bounds = f" (replicas {pool['min_replicas']}..{pool['max_replicas']})"
        lines.append(f"pool {name}{bounds}: {pool.get('waiting', 0)} waiting in the gateway")
        capacity = pool.get("capacity")
        if capacity:
            lines += render_capacity(capacity)
        replicas = pool.get("replicas")
        workers = pool.get("workers", [])
        if replicas is None:  # a gateway without a supervisor: its members, static or joined
            lines += [_worker_line(w) for w in workers]
            continue
        for r in replicas:
            load = (
                "-"
                if r["running"] is None
                else f"running {r['running']:>3} waiting {r['waiting']:>3}"
            )
            kv = ""
            if r.get("kv_total_tokens"):
                used = r["kv_total_tokens"] - r["kv_free_tokens"]
                kv = f" KV {used}/{r['kv_total_tokens']}"
            devices = r.get("devices")
            on = f" on {','.join(map(str, devices))}" if devices else ""
            lines.append(
                f"  {r['id']:<10} {r['state']:<9} {r['url'] or '(restarting)':<24} {load}{kv}"
                + (f" restarts {r['restarts']}" if r.get("restarts") else "")
                + on
            )
        # Members of other hosts, announced in the fleet's Redis (the supervisor's own
        # replicas are above).
        lines += [_worker_line(w) for w in workers if w.get("origin") == "joined"]
        placement = pool.get("placement")
        if placement:
            free = ",".join(map(str, placement["free"])) or "none"
            lines.append(
                f"  devices: {placement['per_replica']} {placement['kind']} per replica; "
                f"free {free} of {placement['host_devices']} "
                f"(room for {placement['startable']} more)"
            )
        decision = pool.get("decision")
        if decision:
            lines.append(
                f"  autoscaler: {decision['num_ordered']} -> {decision['desired_replicas']}: "
                f"{decision['reason']}"
            )
        signals = pool.get("signals")
        if signals:

            def fmt(v: Any) -> str:
                return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

            lines.append(
                f"  signals: queue {fmt(signals['queue_depth'])}, wait "
                f"{fmt(signals['estimated_wait_s'])} s, "
                f"arrivals {fmt(signals['arrivals_per_s'])}/s, "
                f"service {fmt(signals['mean_service_s'])} s"
            )
    return "\n".join(lines)


def _worker_line(w: dict[str, Any]) -> str:
    """One member of a pool as the gateway sees it, and where it came from (config,
    local, joined)."""
    return (
        f"  {w['url']:<28} {w['state']:<10} running {w['running']:>3} "
        f"waiting {w['waiting']:>3} in flight {w['inflight']:>3} ({w.get('origin', 'config')})"
    )


def _s(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def render_capacity(capacity: dict[str, Any]) -> list[str]:
    """A pool's capacity model and its decisions (the `capacity` of GET /admin/fleet):
    its targets, the TTFT predicted for a typical request now, refusals by reason and
    goodput; then each worker's seats, step times and prefill rate."""
    refusals = capacity.get("refusals") or {}
    refused = ", ".join(f"{k} {v}" for k, v in sorted(refusals.items())) or "none"
    served, met = capacity.get("served", 0), capacity.get("goodput", 0)
    share = f" ({100 * met / served:.0f}%)" if served else ""
    lines = [
        f"  capacity: TTFT target {_s(capacity.get('ttft_target_s'))}, "
        f"ITL target {_s(capacity.get('itl_target_s'), 3)}, "
        f"predicted TTFT {_s(capacity.get('predicted_ttft_s'))}, "
        f"completion ratio {capacity.get('completion_ratio', 1.0):.2f}",
        f"  refused: {refused}; goodput {met}/{served} served within targets{share}",
    ]
    for w in capacity.get("workers", []):
        if w.get("seats") is None:
            lines.append(f"    {w['url']:<28} no capacity model reported")
            continue
        rate = w.get("prefill_tokens_per_s")
        measured = f" (measured {_s(w['step_s'], 3)})" if w.get("step_s") is not None else ""
        lines.append(
            f"    {w['url']:<28} seats {w['seats']:>3}, step {_s(w.get('decode_step_s'), 3)}"
            f"{measured}, prefill {'-' if rate is None else f'{rate:.0f}'} tok/s, "
            f"ITL target {_s(w.get('itl_target_s'), 3)}"
        )
    return lines
