"""What this machine's CPU can do, for tests whose expectation depends on it."""

from pathlib import Path


def has_avx512_bf16() -> bool:
    """Whether the CPU has the bf16 dot-product instructions (the native prefill kernel)."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
