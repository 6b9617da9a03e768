"""`switchyard serve`: the parser and the entry point of the whole local stack."""

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cli.serve.config import ServeConfig

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
    if args.join is not None or args.host_id is not None or cfg.fleet.join:
        join_fleet(cfg, args.join, args.host_id)
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


def join_fleet(cfg: "ServeConfig", redis_url: str | None, host_id: str | None) -> None:
    """`--join REDIS_URL [--host-id ID]` (or `fleet.join` in the config): this host joins the
    fleet sharing that Redis (no embedded Redis; pool membership read from and announced
    to it). SystemExit on a bad value."""
    import socket

    from cli.serve.config import check_fleet
    from workers.fleet.hosts import check_host_id

    if redis_url is not None:
        if not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SystemExit(
                f"error: --join takes a Redis URL (redis://HOST:PORT, rediss://, unix://), "
                f"not {redis_url!r}"
            )
        cfg.redis_url = redis_url
        cfg.fleet.join = True
    if host_id is not None:
        if not cfg.fleet.join:
            raise SystemExit("error: --host-id names this host in a fleet: give --join too")
        cfg.fleet.host_id = host_id
    if cfg.fleet.host_id is None:
        cfg.fleet.host_id = socket.gethostname()
    try:
        check_host_id(cfg.fleet.host_id)
    except ValueError as exc:
        raise SystemExit(f"error: --host-id: {exc} (the hostname is the default)") from None
    membership = dict(cfg.gateway.options.get("membership") or {})
    membership["enabled"] = True
    cfg.gateway.options["membership"] = membership
    check_fleet(cfg, "--join")


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
    serve.add_argument(
        "--join",
        default=None,
        metavar="REDIS_URL",
        help="join the fleet of hosts sharing this Redis (quotas, pool membership, the "
        "autoscaler's leader lease): no embedded Redis; this host's workers are announced "
        "to every gateway and its supervisor carries out the elected leader's orders",
    )
    serve.add_argument(
        "--host-id",
        default=None,
        help="this host's name in the fleet (default: the hostname); with --join",
    )
    serve.set_defaults(run=run)
