"""What this machine's CPU can do, for tests whose expectation depends on it."""

from pathlib import Path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def runs_native_kernels(dtype: str) -> bool:
    """Whether the native linear layers (`workers.runner.native.linear`) and prompt attention
    (`workers.runner.native.prefill_attention`) run `dtype` here: AVX-512 (bf16: with the bf16
    dot-product instructions), or else AVX2 with FMA, which runs both dtypes (bf16 widened
    to fp32)."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return dtype != "bfloat16" or "avx512_bf16" in flags
    return {"avx2", "fma"} <= flags
