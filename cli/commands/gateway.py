"""`switchyard gateway`: the public gateway, one process or a `--workers N` group.

A group's parent starts each member as `python -m cli.main ... gateway --member` and sends
it its spec, pickled, on stdin; `--member` is hidden from the help.
"""

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    gw = subparsers.add_parser("gateway", help="the public OpenAI-compatible gateway")
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
    gw.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from cli.config_files import fill, read_yaml
    from cli.serve.stack import StartupError, check_port_free
    from gateway.config import GatewayConfig, split_pool_entries
    from gateway.runtime.main import serve_gateway, serve_member

    if args.member:  # one process of a `--workers N` group: its parent sends the spec
        import pickle

        return serve_member(pickle.load(sys.stdin.buffer))
    raw = read_yaml(args.config)
    try:
        section = split_pool_entries(raw.get("gateway", raw))
    except ValueError as exc:
        raise SystemExit(f"{args.config}: {exc}") from None
    config = fill(GatewayConfig, section, str(args.config))
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
