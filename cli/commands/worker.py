"""`switchyard worker`: serve one model over OpenAI-compatible HTTP (one rank, or a TP group)."""

import argparse
import sys
from pathlib import Path
from typing import NoReturn


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser("worker", help="serve one model over OpenAI-compatible HTTP")
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
    worker.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
    _exit_at_once(serve_worker(model_dir, engine_cfg, worker_cfg, args.host, args.port))


def _exit_at_once(status: int) -> NoReturn:
    """End the process with `status` now that the server and the engine have stopped,
    without the interpreter's teardown: freeing the model's tensors and thread pools one by
    one took 0.6-1.3 s of a drained worker's exit on the 2-core machine, time its
    supervisor and the autoscaler count as draining. Logs and stdio are flushed first."""
    import logging
    import os

    logging.getLogger(__name__).info("exiting with status %d", status)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
