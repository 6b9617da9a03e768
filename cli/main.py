"""`switchyard` command line: the global flags, one subparser per module of `cli.commands`."""

import argparse
import sys

from cli.commands import admin, bench, cascade, gateway, generate, load, models, serve, worker
from cli.logs import setup_logging

# In the order `switchyard --help` lists them.
COMMANDS = (models, generate, worker, gateway, admin, cascade, serve, load, bench)


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
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("debug" if args.verbose else args.log_level, args.log_format)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
