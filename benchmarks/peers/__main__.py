"""``python -m benchmarks.peers``: set up the peer tools, or smoke-test them together.

setup               build llama-server and install GuideLLM (cached), print where they are
build-llama-server  build llama-server only (cached; what scripts/setup.sh runs)
smoke   llama-server on a converted checkpoint, a 2-level GuideLLM sweep against it
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.peers.guidellm import ensure_guidellm, format_table, run_guidellm
from benchmarks.peers.llama_server import (
    LlamaServer,
    LlamaServerError,
    built_llama_server,
    convert_to_gguf,
    describe,
    ensure_llama_server,
)

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "switchyard" / "models" / "smollm2-135m-instruct"


def _progress(t0: float) -> Callable[[str], None]:
    def say(message: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {message}", flush=True)

    return say


def _cpus(text: str | None) -> list[int] | None:
    """``"0"``, ``"0,1"`` or ``"0-3"`` as core ids."""
    if not text:
        return None
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def cmd_setup(args: argparse.Namespace) -> int:
    say = _progress(time.monotonic())
    binary = ensure_llama_server(progress=say)
    print(f"llama-server: {binary} ({describe(binary)['version']})")
    exe = ensure_guidellm(progress=say)
    print(f"guidellm:     {exe}")
    if args.model_dir.exists():
        gguf = convert_to_gguf(args.model_dir, outtype=args.outtype, progress=say)
        print(f"gguf:         {gguf}")
    return 0


def cmd_build_llama_server(args: argparse.Namespace) -> int:
    say = _progress(time.monotonic())
    if built_llama_server() is None:
        say("llama-server: not built for this CPU yet; building (about 15 min on 2 cores)")
    try:
        binary = ensure_llama_server(progress=say)
    except LlamaServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"llama-server: {binary} ({describe(binary)['version']})")
    return 0


def cmd_smoke(args: argparse.Namespace) -> int:
    say = _progress(time.monotonic())
    binary = ensure_llama_server(progress=say)
    exe = ensure_guidellm(progress=say)
    gguf = convert_to_gguf(args.model_dir, outtype=args.outtype, progress=say)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="peers-smoke-"))
    # A key on the server checks that GuideLLM really sends it as a bearer token.
    api_key = secrets.token_hex(16)
    with LlamaServer(
        binary,
        gguf,
        log_dir=out_dir,
        num_slots=args.slots,
        num_threads=args.server_threads,
        cpus=_cpus(args.server_cpus),
        extra_args=["--api-key", api_key],
    ) as server:
        say(f"llama-server up at {server.base_url} (pid {server.pid})")
        levels = run_guidellm(
            server.base_url,
            "smollm2",
            args.model_dir,
            profile="sweep",
            rate=2,
            max_seconds=args.max_seconds,
            max_concurrency=args.max_concurrency,
            data=args.data,
            out_dir=out_dir,
            api_key=api_key,
            max_worker_processes=1,
            cpus=_cpus(args.client_cpus),
            guidellm=exe,
            progress=say,
        )
    print(format_table(levels))
    print(f"report: {out_dir / 'report.json'}")
    return 0 if all(lv.num_successful > 0 and lv.num_errored == 0 for lv in levels) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("setup", "build llama-server, install GuideLLM, convert the model (all cached)"),
        ("smoke", "run llama-server and a 2-level GuideLLM sweep against it"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--model-dir",
            type=Path,
            default=DEFAULT_MODEL_DIR,
            help="Hugging Face checkpoint to convert (default: %(default)s)",
        )
        p.add_argument("--outtype", choices=("f32", "bf16"), default="f32")
        if name == "smoke":
            p.add_argument("--slots", type=int, default=4, help="llama-server -np")
            p.add_argument("--server-threads", type=int, default=1)
            p.add_argument("--server-cpus", default="0", help="cores for llama-server")
            p.add_argument("--client-cpus", default="1", help="cores for GuideLLM")
            p.add_argument("--max-seconds", type=float, default=10.0, help="per level")
            p.add_argument("--max-concurrency", type=int, default=8)
            p.add_argument("--data", default="prompt_tokens=128,output_tokens=32")
            p.add_argument("--out-dir", type=Path, default=None)
    sub.add_parser("build-llama-server", help="build llama-server only (cached)")
    args = parser.parse_args(argv)
    commands = {
        "setup": cmd_setup,
        "build-llama-server": cmd_build_llama_server,
        "smoke": cmd_smoke,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
