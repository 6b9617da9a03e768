"""`switchyard` command line: subcommands parse arguments and build components."""

import argparse
import sys
from pathlib import Path

from cli.commands.admin import add_admin_parser
from cli.commands.cascade import add_cascade_parser
from cli.commands.load import add_load_parser
from cli.commands.models import add_models_parsers
from cli.commands.serve import add_serve_parser
from cli.logs import setup_logging


def _cmd_make_demo(args: argparse.Namespace) -> int:
    from workers.models.demo import make_demo_checkpoints

    paths = make_demo_checkpoints(Path(args.out), show_progress=True)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams
    from workers.errors import EngineError

    try:
        # One prompt: size the KV cache and decode workspace for a handful of sequences.
        config = EngineConfig(
            dtype=args.dtype, device=args.device, scheduler=SchedulerConfig(max_num_seqs=4)
        )
        engine = LLMEngine.from_pretrained(args.model, config)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or [],
        )
        prompt = args.prompt
        if args.chat:
            if engine.tokenizer is None:
                print(f"error: {args.model} has no tokenizer for --chat", file=sys.stderr)
                return 2
            prompt = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
        # A rendered chat prompt holds its special tokens already.
        req = engine.add_request(prompt=prompt, params=params, add_special_tokens=not args.chat)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    print()
    print(
        f"[{req.num_output_tokens} tokens, finish_reason={req.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    import os

    from cli.config_files import fill, read_yaml
    from workers.engine.config import EngineConfig
    from workers.server.config import WorkerConfig, control_exposure_error
    from workers.server.main import serve_worker

    raw = read_yaml(args.config)
    engine_cfg = fill(EngineConfig, raw.get("engine"), f"{args.config}: engine")
    worker_cfg = fill(WorkerConfig, raw.get("worker"), f"{args.config}: worker")
    if args.served_model_name:
        worker_cfg.served_model_names = args.served_model_name
    worker_cfg.control_key = (
        args.control_key
        or worker_cfg.control_key
        or os.environ.get("SWITCHYARD_WORKER_CONTROL_KEY")
        or None
    )
    refusal = control_exposure_error(args.host, worker_cfg.control_key, args.insecure_control)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(
            f"error: {model_dir} is not a Hugging Face checkpoint (no config.json)", file=sys.stderr
        )
        return 2
    from cli.serve.stack import StartupError, check_port_free

    try:
        check_port_free(args.host, args.port, "--port")
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from workers.tp.config import ShardConfig

    shard_cfg = fill(ShardConfig, raw.get("shard_group"), f"{args.config}: shard_group")
    if args.tensor_parallel is not None:
        shard_cfg.tensor_parallel = args.tensor_parallel
    if shard_cfg.tensor_parallel != 1:
        from workers.tp.plan import ShardingError
        from workers.tp.worker import serve_sharded_worker

        level = "debug" if args.verbose else args.log_level
        try:
            return serve_sharded_worker(
                model_dir, engine_cfg, worker_cfg, shard_cfg, args.host, args.port, level
            )
        except ShardingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return serve_worker(model_dir, engine_cfg, worker_cfg, args.host, args.port)


def _cmd_gateway(args: argparse.Namespace) -> int:
    import os

    from cli.config_files import fill, read_yaml
    from cli.serve.stack import StartupError, check_port_free
    from gateway.config import GatewayConfig
    from gateway.runtime.main import serve_gateway, serve_member

    if args.member:  # one process of a `--workers N` group: its parent sends the spec
        import pickle

        return serve_member(pickle.load(sys.stdin.buffer))
    raw = read_yaml(args.config)
    config = fill(GatewayConfig, raw.get("gateway", raw), str(args.config))
    config.admin_key = config.admin_key or os.environ.get("SWITCHYARD_ADMIN_KEY")
    if args.workers is not None:
        config.processes = args.workers
    if not isinstance(config.processes, int) or config.processes < 1:
        print("error: --workers (gateway.processes) must be a whole number >= 1", file=sys.stderr)
        return 2
    if not config.admin_key:
        print(
            "warning: no admin key (gateway.admin_key or SWITCHYARD_ADMIN_KEY): /admin is closed",
            file=sys.stderr,
        )
    try:
        check_port_free(args.host, args.port, "--port")
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    level = "debug" if args.verbose else args.log_level
    member = [sys.executable, "-m", "cli.main", "--log-level", level]
    member += ["--log-format", args.log_format, "gateway", "--member"]
    return serve_gateway(config, args.host, args.port, member)


def _cmd_bench_engine(args: argparse.Namespace) -> int:
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
    from benchmarks.engine_bench import BenchOptions, run_engine_bench

    opts = BenchOptions(
        out_dir=Path(args.out),
        num_requests=args.num_requests,
        hf_sample=args.hf_sample,
        quick=args.quick,
        scenarios=args.scenarios.split(","),
        model_dir=Path(args.model) if args.model else None,
        dtypes=args.dtypes.split(","),
    )
    run_engine_bench(opts)
    return 0


def _cmd_bench_worker(args: argparse.Namespace) -> int:
    from benchmarks.engine_bench import BenchOptions
    from benchmarks.worker_bench import run_worker_bench

    run_worker_bench(
        BenchOptions(out_dir=Path(args.out), num_requests=args.num_requests, quick=args.quick)
    )
    return 0


def _cmd_bench_gateway(args: argparse.Namespace) -> int:
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


def _cmd_bench_upstream(args: argparse.Namespace) -> int:
    from benchmarks.upstream_clients import UpstreamBenchOptions, run_upstream_bench

    run_upstream_bench(UpstreamBenchOptions(Path(args.out), args.requests, args.quick))
    return 0


def _cmd_bench_autoscale(args: argparse.Namespace) -> int:
    from benchmarks.autoscale.bench import AutoscaleBenchOptions, run_autoscale_bench

    run_autoscale_bench(AutoscaleBenchOptions(Path(args.out), quick=args.quick, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Multi-tenant LLM serving.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="default: info",
    )
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="default: text"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="checkpoint tools").add_subparsers(
        dest="action", required=True
    )
    demo = models.add_parser(
        "make-demo", help="write the tiny `small` and `large` demo checkpoints"
    )
    demo.add_argument("--out", default="models", help="output directory (default: models)")
    demo.set_defaults(func=_cmd_make_demo)
    add_models_parsers(models)

    gen = sub.add_parser("generate", help="generate text with the engine, offline")
    gen.add_argument("prompt")
    gen.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_cmd_generate)

    worker = sub.add_parser("worker", help="serve one model over OpenAI-compatible HTTP")
    worker.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=8100)
    worker.add_argument(
        "--config",
        default=None,
        help="YAML with `engine:`, `worker:` and `shard_group:` sections",
    )
    worker.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split the model over N devices (ranks: rank 0 serves, N-1 child processes; "
        "NCCL on GPUs, gloo on CPU); default: shard_group.tensor_parallel, else 1",
    )
    worker.add_argument(
        "--served-model-name", action="append", help="model name(s) to answer to (repeatable)"
    )
    worker.add_argument(
        "--control-key",
        default=None,
        help="bearer key for /drain (default: worker.control_key, $SWITCHYARD_WORKER_CONTROL_KEY)",
    )
    worker.add_argument(
        "--insecure-control",
        action="store_true",
        help="allow a non-loopback --host without a control key (/drain open to the network)",
    )
    worker.set_defaults(func=_cmd_worker)

    gw = sub.add_parser("gateway", help="the public OpenAI-compatible gateway")
    gw.add_argument("--config", default="configs/gateway.yaml")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="N gateway processes on one port (SO_REUSEPORT), each with 1/N of the worker "
        "slots and queue bounds; default: gateway.processes, else 1",
    )
    gw.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    gw.set_defaults(func=_cmd_gateway)

    add_admin_parser(sub)

    add_cascade_parser(sub)
    add_serve_parser(sub)
    add_load_parser(sub)

    bench = sub.add_parser("bench", help="measured comparisons").add_subparsers(
        dest="target", required=True
    )
    be = bench.add_parser("engine", help="engine vs transformers generate / generate_batch")
    be.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    be.add_argument("--num-requests", type=int, default=64)
    be.add_argument("--hf-sample", type=int, default=8, help="requests timed for one-at-a-time HF")
    be.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    be.add_argument(
        "--scenarios",
        default="throughput,decode,prefix,chunked",
        help="comma list of throughput,decode,levers,prefix,chunked,structured",
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
    be.set_defaults(func=_cmd_bench_engine)
    bw = bench.add_parser("worker", help="worker over HTTP (streaming) vs the in-process engine")
    bw.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bw.add_argument("--num-requests", type=int, default=64)
    bw.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    bw.set_defaults(func=_cmd_bench_worker)
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
    bg.set_defaults(func=_cmd_bench_gateway)
    bu = bench.add_parser("upstream", help="upstream HTTP clients' CPU per request, side by side")
    bu.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bu.add_argument("--requests", type=int, default=4000, help="requests per client and mode")
    bu.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    bu.set_defaults(func=_cmd_bench_upstream)
    ba = bench.add_parser("autoscale", help="autoscaler vs baselines and oracles, in simulation")
    ba.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    ba.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    ba.add_argument("--seed", type=int, default=0, help="the arrivals' random seed")
    ba.set_defaults(func=_cmd_bench_autoscale)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("debug" if args.verbose else args.log_level, args.log_format)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
