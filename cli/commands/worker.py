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
    join = worker.add_argument_group(
        "fleet membership",
        "announce this worker as a member of a pool in the fleet's Redis, where every "
        "gateway with membership on finds it (docs/architecture.md, Fleet membership)",
    )
    join.add_argument("--join", metavar="REDIS_URL", default=None, help="the fleet's Redis")
    join.add_argument("--pool", default=None, help="the pool to join (with --join)")
    join.add_argument(
        "--advertise-url",
        default=None,
        metavar="URL",
        help="how gateways reach this worker (default: http://HOST:PORT from --host/--port)",
    )
    join.add_argument(
        "--host-id", default=None, metavar="ID", help="this host in the fleet (default: hostname)"
    )
    join.add_argument(
        "--join-ttl",
        type=float,
        default=None,
        metavar="S",
        help="the membership record's heartbeat TTL in seconds (default 6)",
    )
    worker.set_defaults(run=run)


def join_config(
    args: argparse.Namespace, device: str, max_num_seqs: int | None, model_dir: Path, variant: str
):  # noqa: ANN201 (JoinConfig | None; imported late, with the worker)
    """The worker's `JoinConfig` from its options, or None without --join. Raises
    ValueError saying what is wrong with them."""
    from workers.api.membership import DEFAULT_TTL_S, check_name, check_url
    from workers.fleet.announcer import default_host_id, local_devices
    from workers.models.fingerprint import model_fingerprint
    from workers.server.join import JoinConfig

    if args.join is None:
        if args.pool or args.advertise_url or args.host_id or args.join_ttl is not None:
            raise ValueError("--pool, --advertise-url, --host-id and --join-ttl need --join")
        return None
    if not args.pool:
        raise ValueError("--join needs --pool NAME: the pool this worker serves")
    check_name(args.pool)
    host_id = check_name(args.host_id or default_host_id(), "host")
    if args.advertise_url is None:
        if args.host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"--host {args.host} listens on every address; give --advertise-url, the "
                "address gateways reach this worker at"
            )
        host = f"[{args.host}]" if ":" in args.host else args.host
        advertise = f"http://{host}:{args.port}"
    else:
        advertise = args.advertise_url
    ttl_s = DEFAULT_TTL_S if args.join_ttl is None else args.join_ttl
    if not ttl_s > 0:
        raise ValueError(f"--join-ttl must be > 0, got {ttl_s}")
    return JoinConfig(
        redis_url=args.join,
        pool=args.pool,
        advertise_url=check_url(advertise),
        host_id=host_id,
        fingerprint=model_fingerprint(model_dir, variant),
        devices=local_devices(device),
        max_num_seqs=max_num_seqs,
        ttl_s=ttl_s,
    )


def _reach_redis(url: str) -> str | None:
    """Why the fleet's Redis at `url` cannot be used (None: it answers)."""
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3) as client:
            client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        return f"--join {url}: Redis does not answer ({exc})"
    return None


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
    try:
        join = join_config(
            args,
            engine_cfg.device,
            engine_cfg.scheduler.max_num_seqs if engine_cfg.scheduler else None,
            model_dir,
            "" if engine_cfg.quantization == "none" else f"quantization={engine_cfg.quantization}",
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if join is not None:
        unreachable = _reach_redis(join.redis_url)
        if unreachable:
            print(f"error: {unreachable}", file=sys.stderr)
            return 2
        # Gateways send the pool's name as the model: answer to it too.
        names = worker_cfg.served_model_names or [model_dir.name]
        worker_cfg.served_model_names = names + [join.pool] * (join.pool not in names)
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
                model_dir, engine_cfg, worker_cfg, shard_cfg, args.host, args.port, level, join
            )
        except ShardingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    _exit_at_once(serve_worker(model_dir, engine_cfg, worker_cfg, args.host, args.port, join=join))


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
