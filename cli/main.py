"""`switchyard` command line: subcommands parse arguments and build components."""

import argparse
import logging
import sys
from pathlib import Path


def _cmd_make_demo(args: argparse.Namespace) -> int:
    from workers.checkpoints import make_demo_checkpoints

    paths = make_demo_checkpoints(Path(args.out), show_progress=True)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.errors import EngineError
    from workers.sampling_params import SamplingParams

    try:
        engine = LLMEngine.from_pretrained(
            args.model, EngineConfig(dtype=args.dtype, device=args.device)
        )
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
            assert engine.tokenizer is not None
            prompt = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
        req = engine.add_request(prompt=prompt, params=params)
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
    from cli.config_files import fill, read_yaml
    from workers.config import EngineConfig
    from workers.process import serve_worker
    from workers.service import WorkerConfig

    raw = read_yaml(args.config)
    engine_cfg = fill(EngineConfig, raw.get("engine"), f"{args.config}: engine")
    worker_cfg = fill(WorkerConfig, raw.get("worker"), f"{args.config}: worker")
    if args.served_model_name:
        worker_cfg.served_model_names = args.served_model_name
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(
            f"error: {model_dir} is not a Hugging Face checkpoint (no config.json)", file=sys.stderr
        )
        return 2
    serve_worker(model_dir, engine_cfg, worker_cfg, args.host, args.port)
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from benchmarks.engine_bench import BenchOptions, run_engine_bench

    opts = BenchOptions(
        out_dir=Path(args.out),
        num_requests=args.num_requests,
        hf_sample=args.hf_sample,
        quick=args.quick,
        scenarios=args.scenarios.split(","),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Multi-tenant LLM serving.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="checkpoint tools").add_subparsers(
        dest="action", required=True
    )
    demo = models.add_parser(
        "make-demo", help="write the tiny `small` and `large` demo checkpoints"
    )
    demo.add_argument("--out", default="models", help="output directory (default: models)")
    demo.set_defaults(func=_cmd_make_demo)

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
    worker.add_argument("--config", default=None, help="YAML with `engine:` and `worker:` sections")
    worker.add_argument(
        "--served-model-name", action="append", help="model name(s) to answer to (repeatable)"
    )
    worker.set_defaults(func=_cmd_worker)

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
        default="throughput,prefix,chunked",
        help="comma list of throughput,prefix,chunked",
    )
    be.set_defaults(func=_cmd_bench_engine)
    bw = bench.add_parser("worker", help="worker over HTTP (streaming) vs the in-process engine")
    bw.add_argument("--out", default="bench-results", help="where JSON and markdown go")
    bw.add_argument("--num-requests", type=int, default=64)
    bw.add_argument("--quick", action="store_true", help="a small smoke run, not the real figures")
    bw.set_defaults(func=_cmd_bench_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
