"""`switchyard serve`: the parser and the entry point of the whole local stack."""

import argparse
import signal
import sys
from pathlib import Path

DEFAULT_CONFIG = Path("configs/serve.yaml")


def run(args: argparse.Namespace) -> int:
    from cli.serve.config import load_serve_config
    from cli.serve.stack import RunOptions, StartupError, run_serve

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # before the loop owns signals: stop where we are, cleanly

    signal.signal(signal.SIGTERM, interrupted)
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    cfg = load_serve_config(path)
    if args.port is not None:
        cfg.gateway.port = args.port
    if args.host is not None:
        cfg.gateway.host = args.host
    if args.data_dir is not None:
        cfg.data_dir = str(Path(args.data_dir).resolve())
    if args.no_autoscale:
        cfg.fleet.autoscale = False
    opts = RunOptions(
        Path(path) if path else None,
        log_level="debug" if args.verbose else args.log_level,
        log_format=args.log_format,
    )
    try:
        return run_serve(cfg, opts)
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from cli.serve.config import defaults_yaml

    serve = subparsers.add_parser(
        "serve",
        help="the whole stack on this machine: Redis, gateway, workers, autoscaler",
        description=(
            "Start the embedded Redis, the gateway and a supervisor of worker processes per "
            "pool (fetching or making the models first), wait until all are ready, print the "
            "base URL (and, at first start, a demo API key), and serve in the foreground "
            "until Ctrl-C or SIGTERM, which drains and stops everything."
        ),
        epilog="The built-in defaults (a config file overrides any of them; relative paths "
        "in it resolve against the file's directory):\n\n" + defaults_yaml(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--config",
        default=None,
        help=f"the stack's YAML (default: {DEFAULT_CONFIG} when it exists, else the defaults "
        "below)",
    )
    serve.add_argument("--host", default=None, help="the gateway's host (default: gateway.host)")
    serve.add_argument(
        "--port", type=int, default=None, help="the gateway's port (default: gateway.port)"
    )
    serve.add_argument("--data-dir", default=None, help="default: data_dir of the config")
    serve.add_argument(
        "--no-autoscale", action="store_true", help="keep every pool at its min_replicas"
    )
    serve.set_defaults(run=run)
