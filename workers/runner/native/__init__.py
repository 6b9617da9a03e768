"""Our own CPU kernels for the shapes of the engine's hot loop where torch is the slow path.

Each kernel is C++ built on this machine with torch's extension builder (ninja and the
system C++ compiler, `-O3 -march=native`) into torch's extension cache, the first time it
is asked for; `python -m workers.runner.native` builds them ahead (`scripts/setup.sh` does), so
no worker pays the build (about 30 s) at start-up. The build is named after this CPU's
instruction set and a hash of its source and flags, so a cache shared with another kind
of CPU, or holding a build of older source, is never loaded for it; a build that is there
is imported directly, without torch's build lock.

A machine without a compiler, a failed build, `SWITCHYARD_NATIVE_KERNELS=0`, or a tensor
not on the CPU gets the torch implementation instead; the log says which and why, once.

The kernels hold the GIL while they run, on purpose. Released, the worker's event loop
(streaming 64 requests' tokens) ran beside the engine thread on a core one of the
kernel's OpenMP threads needed, and every parallel region waited for the thread it had
pushed off: `switchyard bench worker` over HTTP fell from 629 to 524 tok/s against 753
in-process (2 cores). Held, the loop runs in the gaps between kernels (torch's own ops
release the GIL) and the step runs on both cores undisturbed.
"""

import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
DISABLE_ENV = "SWITCHYARD_NATIVE_KERNELS"
# -ffast-math lets the loops vectorise (sums reassociated, exp from libmvec); the kernels
# keep every rounding to the storage dtype that torch makes, so results differ from
# torch's only in the last bits of fp32 arithmetic.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

# (q, k_new, v_new, k_workspace, v_workspace, lengths, scale, out) -> None
DecodeAttention = Callable[..., None]
# (q, k, v, scale, out) -> None
PrefillAttention = Callable[..., None]
# (q, k_cache, v_cache, block_tables, lengths, block_size, scale, out) -> None
PagedDecodeAttention = Callable[..., None]


def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        text = platform.processor() + platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name"))][:2]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


def _ensure_ninja() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel puts it beside Python."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").lower() not in ("0", "false", "no", "off")


STALE_LOCK_S = 600.0  # a build lock older than this was left by a killed build


def _clear_stale_lock(build_dir: Path) -> None:
    """torch waits forever on the lock of a build whose process was killed (a worker
    stopped mid-build); a build takes about 30 s, so an old lock is such a leftover."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing a stale build lock %s", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _module_name(name: str) -> str:
    """The extension's name: the kernel's, this CPU's instruction set, and a hash of what
    its build depends on (the source, the shared headers, the flags, torch's version), so
    that a build of other source is never taken for this one and a built one can be
    imported as it is."""
    import torch

    source = (SOURCE_DIR / f"{name}.cpp").read_bytes()
    headers = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h"))]
    what = b"\n".join([source, *headers, " ".join(CFLAGS).encode(), torch.__version__.encode()])
    return f"switchyard_{name}_{_cpu_tag()}_{hashlib.sha1(what).hexdigest()[:10]}"


def _import_built(module_name: str, build_dir: Path):
    """The extension from its build directory if it was built there, else None.

    This takes no lock and runs no ninja: torch's `load` does both even for an extension
    that is up to date, so a worker killed in that window (a replica stopped while it
    starts) left a lock that hung every later start, and each start paid the check."""
    import importlib.util

    path = build_dir / f"{module_name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # a build cut short: build it again
        log.warning("native kernel %s could not be imported (%s); rebuilding", path, exc)
        return None
    return module


@functools.cache
def _build(name: str):
    """Build (or load from the cache) one extension; None, logged, when it cannot be built."""
    from torch.utils.cpp_extension import _get_build_directory, load

    t0 = time.perf_counter()
    try:
        module_name = _module_name(name)
        build_dir = Path(_get_build_directory(module_name, verbose=False))
        module = _import_built(module_name, build_dir)
        if module is None:
            _ensure_ninja()
            _clear_stale_lock(build_dir)
            module = load(
                name=module_name,
                sources=[str(SOURCE_DIR / f"{name}.cpp")],
                extra_cflags=CFLAGS,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a compile error: torch's path runs
        log.warning("native kernel %s unavailable, using torch's: %s", name, exc)
        return None
    log.info("native kernel %s ready in %.1fs", name, time.perf_counter() - t0)
    return module


def _kernel(name: str):
    """The module built from `name`.cpp, or None (switched off, or it cannot be built)."""
    if not enabled():
        log.info("native kernels off (%s=0): %s runs in torch", DISABLE_ENV, name)
        return None
    return _build(name)


KERNELS = (
    "decode_attention",
    "fused_ops",
    "kv_int8",
    "linear",
    "prefill_attention",
    "quant_linear",
)


def build_all() -> bool:
    """Build (or load) every kernel now; whether all of them built. prefill_attention and
    linear are built on any CPU, and say where they have no code path."""
    return all([_kernel(name) is not None for name in KERNELS])


def fused_ops():
    """The module of fused per-layer ops (`fused_ops.cpp`: rms_norm, add_rms_norm_, rope,
    silu_mul, write_kv, argmax_rows), or None."""
    return _kernel("fused_ops")


def prefill_attention(dtype: str, head_dim: int) -> PrefillAttention | None:
    """The prompt-chunk attention kernel (`prefill_attention.cpp`) for `dtype` ("float32"
    or "bfloat16") at `head_dim`, or None: switched off, no build, a head dim it has no
    code for, or a CPU without AVX-512 (bf16: and AVX512-BF16)."""
    module = _kernel("prefill_attention")
    if module is None or not module.supports(head_dim, dtype):
        return None
    return module.prefill_attention


def paged_decode_attention() -> PagedDecodeAttention | None:
    """The decode-attention kernel over the paged cache in place (`decode_attention.cpp`),
    or None."""
    module = _kernel("decode_attention")
    return None if module is None else module.paged_decode_attention


def decode_attention() -> DecodeAttention | None:
    """The workspace decode-attention kernel (`decode_attention.cpp`), or None."""
    module = _kernel("decode_attention")
    return None if module is None else module.decode_attention


def kv_int8():
    """The int8 KV cache's kernels (`kv_int8.cpp`: write_kv, dequantize_blocks and the decode
    attention over int8 rows and blocks), or None; AVX-512 or AVX2 where the CPU has them,
    scalar loops elsewhere."""
    return _kernel("kv_int8")


def linear(dtype: str):
    """The linear-layer module (`linear.cpp`: pack, unpack, linear) for `dtype`
    ("float32" or "bfloat16"), or None: switched off, no build, or a CPU with neither
    AVX-512 (bf16: with AVX512-BF16) nor AVX2 and FMA."""
    module = _kernel("linear")
    if module is None or not module.supports(dtype):
        return None
    return module


def quant_linear():
    """The linear layers on quantized weights (`quant_linear.cpp`: int8 per row and q4 per
    group of 32, packed into tiles and decoded in the tile loop), or None: switched off or
    no build. Its `path(dtype)` is "" on a CPU with neither AVX-512 nor AVX2 with FMA and
    F16C, where the weights are dequantized by torch instead (`workers.runner.quant`)."""
    return _kernel("quant_linear")
