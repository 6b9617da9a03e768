"""What this machine's CPU can do, for tests whose expectation depends on it."""

from pathlib import Path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def runs_native_prefill(dtype: str) -> bool:
    """Whether the native prompt-attention kernel runs `dtype` here: AVX-512, and for
    bf16 the bf16 dot-product instructions too."""
    need = {"avx512f"} | ({"avx512_bf16"} if dtype == "bfloat16" else set())
    return need <= cpu_flags()


def has_avx512_bf16() -> bool:
    """AVX-512 with the bf16 dot-product instructions: what the native linear layers
    (`workers.native.linear`) need for bf16."""
    return {"avx512f", "avx512_bf16"} <= cpu_flags()
