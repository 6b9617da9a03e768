"""How many bytes the process's C heap has in use: what a grammar build is charged by.

glibc's `mallinfo2` sums every arena (chunks in use plus mmapped ones); llguidance, torch
and CPython's larger objects allocate there. It walks the arenas' free lists, so a call
takes a fraction of a millisecond: call it per build, never per step. Without glibc, the
resident set stands in (it does not shrink when memory is freed, so it over-counts).
"""

import ctypes
import os


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mallinfo2() -> "ctypes._NamedFuncPointer | None":
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is not None:
        fn.restype = _MallInfo2
        fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int:
    """Bytes of the C heap in use now (the whole process: every thread's allocations)."""
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return int(info.uordblks + info.hblkhd)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
