"""`switchyard bench engine | worker | gateway | foreign | upstream | autoscale | slo | resume |
dtype`: measured comparisons."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def _cmd_engine(args: argparse.Namespace) -> int:
    if args.tensor_parallel is not None:
        from benchmarks.engine_tp import TPBenchOptions, run_tp_bench

        run_tp_bench(
            TPBenchOptions(
                out_dir=Path(args.out),
                tensor_parallel=args.tensor_parallel,
                num_requests=args.num_requests,
                quick=args.quick,
                device=args.device,
                model_dir=Path(args.model) if args.model else None,
            )
        )
        return 0
    scenarios = args.scenarios.split(",")
    if "kv-int8" in scenarios:  # its own report, on the real model (benchmarks/engine_kv.py)
        scenarios.remove("kv-int8")
        status = _kv_int8_bench(args)
        if status != 0 or not scenarios:
            return status
    if "quantized" in scenarios:  # its own report, on the real model (engine_quant.py)
        scenarios.remove("quantized")
        status = _quantized_bench(args)
        if status != 0 or not scenarios:
            return status
    from benchmarks.engine_bench import BenchOptions, run_engine_bench

    opts = BenchOptions(
        out_dir=Path(args.out),
        num_requests=args.num_requests,
        hf_sample=args.hf_sample,
        quick=args.quick,
        scenarios=scenarios,
        model_dir=Path(args.model) if args.model else None,
        dtypes=args.dtypes.split(","),
    )
    run_engine_bench(opts)
    return 0


def _kv_int8_bench(args: argparse.Namespace) -> int:
    """int8 KV beside bf16 KV on --model, else the default model (fetched once)."""
    from benchmarks.engine_kv import KVBenchOptions, run_kv_bench

    if args.model:
        model_dir = Path(args.model)
    else:
        from cli.commands.models import cache_dir
        from workers.errors import ModelFetchError
        from workers.models.fetch import fetch_model
        from workers.models.registry import default_model

        try:
            model_dir = fetch_model(default_model(), cache_dir(None)).path
        except ModelFetchError as exc:
            print(f"error: the default model: {exc}", file=sys.stderr)
            return 2
    run_kv_bench(KVBenchOptions(out_dir=Path(args.out), model_dir=model_dir, quick=args.quick))
    return 0


def _quantized_bench(args: argparse.Namespace) -> int:
    """Quantized weights beside the float engine and llama-server, on --model, else the
    default model (fetched once)."""
    from benchmarks.engine_quant import QuantBenchOptions, run_quant_bench
    from cli.commands.models import cache_dir

    cache = cache_dir(None)
    if args.model:
        model_dir = Path(args.model)
    else:
        from workers.errors import ModelFetchError
        from workers.models.fetch import fetch_model
        from workers.models.registry import default_model

        try:
            model_dir = fetch_model(default_model(), cache).path
        except ModelFetchError as exc:
            print(f"error: the default model: {exc}", file=sys.stderr)
            return 2
    opts = QuantBenchOptions(Path(args.out), model_dir, quick=args.quick, cache=cache)
    run_quant_bench(opts)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from benchmarks.engine_bench import BenchOptions
    from benchmarks.worker_bench import run_worker_bench

    run_worker_bench(
        BenchOptions(out_dir=Path(args.out), num_requests=args.num_requests, quick=args.quick)
    )
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    from benchmarks.gateway_bench import GatewayBenchOptions, run_gateway_bench
    from benchmarks.gateway_paths import PeerOptions

    if args.peer and args.peer_cmd:
        print("error: --peer and --peer-cmd are alternatives; give one", file=sys.stderr)
        return 2
    peer = PeerOptions(
        url=args.peer,
        pid=args.peer_pid,
        cmd=args.peer_cmd,
        ready_path=args.peer_ready_path,
        key=args.peer_key,
        model=args.peer_model,
    )
    run_gateway_bench(
        GatewayBenchOptions(
            Path(args.out),
            quick=args.quick,
            overload_s=args.overload_s,
            backend_port=args.backend_port,
            peer=peer,
        )
    )
    return 0


def _cmd_foreign(args: argparse.Namespace) -> int:
    from benchmarks.foreign_bench import PARTS, ForeignBenchOptions, run_foreign_bench

    if min(args.slots, args.threads, args.pairs, args.burst_factor) < 1:
        print("error: --slots, --threads, --pairs and --burst-factor must be >= 1", file=sys.stderr)
        return 2
    skip = tuple(part.strip() for part in args.skip.split(",") if part.strip())
    if unknown := sorted(set(skip) - set(PARTS)):
        print(
            f"error: --skip {','.join(unknown)}: expected some of {','.join(PARTS)}",
            file=sys.stderr,
        )
        return 2
    if args.cascade_rate <= 0 or args.cascade_duration <= 0:
        print("error: --cascade-rate and --cascade-duration must be > 0", file=sys.stderr)
        return 2
    if not 0.0 <= args.cascade_hard_share <= 1.0:
        print("error: --cascade-hard-share must be within 0..1", file=sys.stderr)
        return 2
    run_foreign_bench(
        ForeignBenchOptions(
            Path(args.out),
            slots=args.slots,
            threads=args.threads,
            ctx_per_slot=args.ctx_per_slot,
            num_pairs=args.pairs,
            max_tokens=args.max_tokens,
            ttft_target_s=args.ttft_target,
            burst_factor=args.burst_factor,
            burst_tokens=args.burst_tokens,
            gguf=Path(args.gguf) if args.gguf else None,
            poll_interval_s=args.poll_interval,
            skip=skip,
            cascade_rate_per_s=args.cascade_rate,
            cascade_duration_s=args.cascade_duration,
            cascade_hard_share=args.cascade_hard_share,
            cascade_model=Path(args.cascade_model) if args.cascade_model else None,
            seed=args.seed,
        )
    )
    return 0


def _cmd_upstream(args: argparse.Namespace) -> int:
    from benchmarks.upstream_clients import UpstreamBenchOptions, run_upstream_bench

    run_upstream_bench(UpstreamBenchOptions(Path(args.out), args.requests, args.quick))
    return 0


def _cmd_autoscale(args: argparse.Namespace) -> int:
    from benchmarks.autoscale.bench import AutoscaleBenchOptions, run_autoscale_bench

    run_autoscale_bench(AutoscaleBenchOptions(Path(args.out), quick=args.quick, seed=args.seed))
    return 0


def _cmd_multihost(args: argparse.Namespace) -> int:
    from benchmarks.multihost_bench import MultiHostOptions, run_multihost_bench

    opts = MultiHostOptions(
        Path(args.out), quick=args.quick, trials=args.trials, ttl_s=args.ttl, poll_s=args.poll
    )
    try:
        run_multihost_bench(opts)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_slo(args: argparse.Namespace) -> int:
    from benchmarks.slo.bench import run_slo_bench
    from benchmarks.slo.levels import ITL_RULES
    from benchmarks.slo.plan import MIXES, SKIPPABLE
    from benchmarks.slo.run import SloBenchOptions

    def items(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    mixes, skip = tuple(items(args.mixes)), frozenset(items(args.skip))
    if not mixes or set(mixes) - set(MIXES):
        print(f"error: --mixes takes some of {','.join(MIXES)}", file=sys.stderr)
        return 2
    if skip - set(SKIPPABLE):
        print(f"error: --skip takes some of {','.join(SKIPPABLE)}", file=sys.stderr)
        return 2
    if args.itl_rule not in ITL_RULES:
        print(f"error: --itl-rule takes one of {','.join(ITL_RULES)}", file=sys.stderr)
        return 2
    try:
        factors = tuple(float(f) for f in items(args.factors))
        seqs = tuple(int(n) for n in items(args.oracle_seqs))
    except ValueError:
        print("error: --factors takes numbers, --oracle-seqs whole numbers", file=sys.stderr)
        return 2
    if not factors or any(f <= 0 for f in factors) or any(n < 1 for n in seqs):
        print("error: --factors must be > 0 and --oracle-seqs >= 1", file=sys.stderr)
        return 2
    run_slo_bench(
        SloBenchOptions(
            config=Path(args.config),
            out=Path(args.out) if args.out else None,
            mixes=mixes,
            factors=factors,
            duration_s=args.duration,
            capacity_s=args.capacity_duration,
            capacity_concurrency=args.capacity_concurrency,
            capacity_per_s=args.capacity,
            skip=skip,
            oracle_seqs=seqs,
            oracle_duration_s=args.oracle_duration,
            llama_slots=args.llama_slots,
            llama_threads=args.llama_threads,
            guidellm_levels=args.guidellm_levels,
            itl_rule=args.itl_rule,
            tenants=args.tenants,
            seed=args.seed,
            work_dir=Path(args.work_dir) if args.work_dir else None,
        )
    )
    return 0


def _cmd_dtype(args: argparse.Namespace) -> int:
    from benchmarks.dtype_bench import DtypeBenchOptions, run_dtype_bench

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():  # a known model's name: fetched once
        from cli.commands.models import cache_dir
        from workers.errors import ModelFetchError
        from workers.models.fetch import fetch_model
        from workers.models.registry import find_model

        try:
            model_dir = fetch_model(find_model(args.model), cache_dir(None)).path
        except ModelFetchError as exc:
            print(f"error: --model {args.model}: {exc}", file=sys.stderr)
            return 2
    run_dtype_bench(DtypeBenchOptions(model_dir, Path(args.out), args.num_tokens))
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from benchmarks.resume_bench import ResumeBenchOptions, run_resume_bench
    from cli.commands.models import cache_dir
    from workers.errors import ModelFetchError
    from workers.models.fetch import fetch_model
    from workers.models.registry import default_model, find_model

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        try:
            model = find_model(args.model) if args.model else default_model()
            model_dir = fetch_model(model, cache_dir(None)).path
        except ModelFetchError as exc:
            print(f"error: --model {args.model}: {exc}", file=sys.stderr)
            return 2
    data = run_resume_bench(
        ResumeBenchOptions(
            Path(args.out),
            model_dir,
            kills=args.kills,
            max_tokens=args.max_tokens,
            max_cut=args.max_cut,
            seed=args.seed,
            drain_tokens=args.drain_tokens,
            drain_grace_s=args.drain_grace,
        )
    )
    print(Path(args.out, "resume.md").read_text())
    return 0 if data["texts_not_identical"] == 0 else 1


# The bench target (`args.target`) -> its handler.
ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "engine": _cmd_engine,
    "multihost": _cmd_multihost,
    "worker": _cmd_worker,
    "gateway": _cmd_gateway,
    "foreign": _cmd_foreign,
    "resume": _cmd_resume,
    "upstream": _cmd_upstream,
    "autoscale": _cmd_autoscale,
    "dtype": _cmd_dtype,
    "slo": _cmd_slo,
}


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.target](args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench_parser = subparsers.add_parser("bench", help="measured comparisons")
    bench_parser.set_defaults(run=run)
    bench = bench_parser.add_subparsers(dest="target", required=True)
    be = bench.add_parser("engine", help="engine vs transformers generate / generate_batch")
    be.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    be.add_argument("--num-requests", type=int, default=64)
    be.add_argument("--hf-sample", type=int, default=8, help="requests timed for one-at-a-time HF")
    be.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    be.add_argument(
        "--scenarios",
        default="throughput,decode,prefix,chunked",
        help="comma list of throughput,decode,levers,prefix,chunked,structured,speculative,"
        "kv-int8,quantized (speculative: n-gram speculation at c=1 on the real default model "
        "unless --model; kv-int8: int8 KV beside bf16 KV on the same, its own engine-kv-int8 "
        "report; quantized: int8 and q4 weights beside fp32/bf16 and llama-server, its own "
        "engine-quantized report)",
    )
    be.add_argument(
        "--model", default=None, help="a local checkpoint dir (default: a random ~32M Llama)"
    )
    be.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma list: throughput and roofline run once per dtype, beside transformers",
    )
    be.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="instead of the scenarios: the engine over N ranks beside N = 1 (engine-tp report)",
    )
    be.add_argument("--device", default="cpu", help="with --tensor-parallel: cpu or cuda")
    bm = bench.add_parser(
        "multihost",
        help="two gateways on two hosts (network namespaces; root) in front of workers on both",
    )
    bm.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bm.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    bm.add_argument("--trials", type=int, default=10, help="deaths of host B's backend")
    bm.add_argument("--ttl", type=float, default=2.0, help="the members' heartbeat TTL, s")
    bm.add_argument("--poll", type=float, default=0.5, help="the gateways' membership poll, s")
    bw = bench.add_parser("worker", help="worker over HTTP (streaming) vs the in-process engine")
    bw.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bw.add_argument("--num-requests", type=int, default=64)
    bw.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    bg = bench.add_parser("gateway", help="gateway in front of a fake backend vs the backend alone")
    bg.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bg.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    bg.add_argument("--overload-s", type=float, default=60.0, help="length of the overload run")
    bg.add_argument(
        "--backend-port", type=int, default=None, help="put the fake backend on this port"
    )
    bg.add_argument(
        "--peer",
        default=None,
        metavar="URL",
        help="a peer gateway started by hand in front "
        "of the fake backend (see --backend-port), measured beside Switchyard",
    )
    bg.add_argument(
        "--peer-pid", type=int, default=None, help="the --peer's process, for its CPU figure"
    )
    bg.add_argument(
        "--peer-cmd",
        default=None,
        metavar="TEMPLATE",
        help="a shell command that starts a peer gateway; {backend} (fake backend base URL), "
        "{port} (a free port for the peer) and {dir} (a temp dir) are filled in "
        "(docs/benchmarks/gateway-peer.md)",
    )
    bg.add_argument(
        "--peer-ready-path", default="/health", help="polled until the peer answers 200"
    )
    bg.add_argument(
        "--peer-key", default=None, help="bearer token sent to the peer (default: a dummy)"
    )
    bg.add_argument("--peer-model", default="small", help="model name sent to the peer")
    bf = bench.add_parser(
        "foreign",
        help="gateway in front of llama-server (a llamacpp pool) vs llama-server alone: added "
        "latency and CPU, a burst past its slots under a TTFT target; the cascade over a "
        "worker pool and it on a mixed load (docs/benchmarks/foreign-pools.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bf.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bf.add_argument("--slots", type=int, default=2, help="llama-server -np")
    bf.add_argument("--threads", type=int, default=1, help="llama-server -t")
    bf.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server -c / slots")
    bf.add_argument("--pairs", type=int, default=100, help="sequential requests per path and mode")
    bf.add_argument("--max-tokens", type=int, default=4, help="tokens of each sequential request")
    bf.add_argument("--ttft-target", type=float, default=2.0, help="the pool's ttft_target_s")
    bf.add_argument("--burst-factor", type=int, default=4, help="burst size, in slots")
    bf.add_argument("--burst-tokens", type=int, default=64, help="max_tokens of each burst stream")
    bf.add_argument("--gguf", default=None, help="a .gguf (None: the default model's own)")
    bf.add_argument(
        "--poll-interval", type=float, default=0.2, help="the gateway's load_poll_interval_s"
    )
    bf.add_argument(
        "--skip", default="", help="comma list of sequential,burst,cascade to leave out"
    )
    bf.add_argument(
        "--cascade-rate", type=float, default=1.0, help="mixed load: Poisson arrivals per second"
    )
    bf.add_argument(
        "--cascade-duration",
        type=float,
        default=30.0,
        help="mixed load: seconds of arrivals per way",
    )
    bf.add_argument(
        "--cascade-hard-share", type=float, default=0.3, help="mixed load: share of hard prompts"
    )
    bf.add_argument(
        "--cascade-model",
        default=None,
        help="the small pool's checkpoint dir (None: the default model, fetched once)",
    )
    bf.add_argument("--seed", type=int, default=0, help="the mixed load's random seed")
    br = bench.add_parser(
        "resume",
        help="SIGKILL the worker of a stream mid-answer, N times: the time to the client's "
        "next token against an unloaded resume's TTFT, and the text against the "
        "uninterrupted answer's",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    br.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    br.add_argument("--kills", type=int, default=20, help="streams killed")
    br.add_argument("--max-tokens", type=int, default=80, help="tokens of each stream")
    br.add_argument("--max-cut", type=int, default=40, help="kill after 4 to this many tokens")
    br.add_argument(
        "--drain-tokens", type=int, default=2000,
        help="the stream a drained worker holds, in tokens (0: no drain figures)",
    )  # fmt: skip
    br.add_argument(
        "--drain-grace", type=float, default=10.0,
        help="the drain's grace before the stream is handed over (the worker's default)",
    )  # fmt: skip
    br.add_argument("--model", default=None, help="a known model (default: the default model)")
    br.add_argument("--model-dir", default=None, help="a local checkpoint instead")
    br.add_argument("--seed", type=int, default=0, help="the cuts' random seed")
    bu = bench.add_parser("upstream", help="upstream HTTP clients' CPU per request, side by side")
    bu.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bu.add_argument("--requests", type=int, default=4000, help="requests per client and mode")
    bu.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    ba = bench.add_parser("autoscale", help="autoscaler vs baselines and oracles, in simulation")
    ba.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    ba.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    ba.add_argument("--seed", type=int, default=0, help="the arrivals' random seed")
    bd = bench.add_parser(
        "dtype",
        help="bfloat16 against float32 on a model: greedy closeness and step speed",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bd.add_argument(
        "--model", default="smollm2-135m-instruct", help="a known model's name or a checkpoint dir"
    )
    bd.add_argument("--out", default="bench-results/dtype.json", help="the JSON report")
    bd.add_argument("--num-tokens", type=int, default=48, help="greedy tokens per prompt")
    bs = bench.add_parser(
        "slo",
        help="latency targets under open-loop load: the stack beside today's admission, an "
        "oracle batch size and llama-server, GuideLLM beside (docs/benchmarks/slo.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bs.add_argument("--config", default="configs/serve.yaml", help="the serve config to start")
    bs.add_argument("--out", default="bench-results/slo.json", help="the JSON report")
    bs.add_argument("--mixes", default="tour,long-heavy", help="comma list of tour,long-heavy")
    bs.add_argument(
        "--factors", default="0.25,0.5,1,2,3", help="offered load, multiples of the capacity"
    )
    bs.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per level")
    bs.add_argument(
        "--capacity-duration", type=float, default=15.0, help="the closed loop's counted seconds"
    )
    bs.add_argument("--capacity-concurrency", type=int, default=8, help="closed-loop streams")
    bs.add_argument(
        "--capacity", type=float, default=None, help="requests/s: use this, measure nothing"
    )
    bs.add_argument(
        "--skip", default="", help="comma list of baseline,oracle,llama,guidellm to leave out"
    )
    bs.add_argument(
        "--oracle-seqs", default="2,4,8,16", help="the oracle's static max_num_seqs sweep"
    )
    bs.add_argument(
        "--oracle-duration",
        type=float,
        default=None,
        help="seconds of arrivals per oracle level (None: half of --duration)",
    )
    bs.add_argument("--llama-slots", type=int, default=4, help="llama-server -np")
    bs.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    bs.add_argument("--guidellm-levels", type=int, default=5, help="GuideLLM's sweep size")
    bs.add_argument(
        "--itl-rule",
        default="p99",
        help="a request meets the ITL target when its own p99 gap (p99) or its largest (max) does",
    )
    bs.add_argument("--tenants", type=int, default=2, help="tenants slo-1..N, one key each")
    bs.add_argument("--seed", type=int, default=0, help="the arrivals' random seed")
    bs.add_argument(
        "--work-dir",
        default=None,
        help="stack configs, logs, GuideLLM's report (None: a new temp dir)",
    )
