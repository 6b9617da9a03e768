"""A native kernel built for another instruction set than this CPU's best, so that a test on
an AVX-512 machine also runs the AVX2 code path (and the scalar one) of the same source.

Built with torch's extension builder into its cache, named after the source's hash and the
flags, so only the first run pays the build (about a minute on two cores).
"""

import hashlib
from pathlib import Path

from tests.support.cpu import cpu_flags
from workers.runner import native

# The kinds of CPU a variant stands for: -march values every x86-64 compiler knows.
MARCH = {"avx2": "haswell", "scalar": "x86-64"}


def can_run(variant: str) -> bool:
    """Whether this CPU runs the variant's instructions, and it is not already the native
    build's path (AVX2 on a CPU without AVX-512 is what `native` builds anyway)."""
    flags = cpu_flags()
    if variant == "avx2":
        return {"avx2", "fma"} <= flags and "avx512f" in flags
    return variant == "scalar" and "sse2" in flags


def build_variant(name: str, variant: str):
    """The module of `name`.cpp built for `variant` ("avx2" or "scalar")."""
    from torch.utils.cpp_extension import load

    source = native.SOURCE_DIR / f"{name}.cpp"
    headers = b"".join(p.read_bytes() for p in sorted(native.SOURCE_DIR.glob("*.h")))
    flags = ["-O3", f"-march={MARCH[variant]}", "-ffast-math", "-fopenmp"]
    digest = hashlib.sha1(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()
    return load(
        name=f"switchyard_test_{name}_{variant}_{digest[:10]}",
        sources=[str(Path(source))],
        extra_cflags=flags,
        verbose=False,
    )
