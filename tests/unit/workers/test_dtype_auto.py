"""`dtype: auto`: bfloat16 where the device multiplies it natively, else float32."""

import torch

from tests.support.cpu import cpu_flags
from workers.engine.config import EngineConfig
from workers.runner.loader import cpu_has_fast_bf16, resolve_dtype
from workers.runner.runner import ModelRunner

ZEN4 = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n"
ZEN3 = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n"
SAPPHIRE = "model name\t: Intel Xeon\nflags\t\t: avx2 avx512f amx_bf16 amx_tile\n"


def test_native_bf16_is_avx512_bf16_or_amx() -> None:
    assert cpu_has_fast_bf16(ZEN4) and cpu_has_fast_bf16(SAPPHIRE)
    assert not cpu_has_fast_bf16(ZEN3) and not cpu_has_fast_bf16("")


def test_auto_resolves_for_this_cpu_and_named_dtypes_pass_through() -> None:
    cpu = torch.device("cpu")
    native = "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags()
    assert resolve_dtype("auto", cpu) == ("bfloat16" if native else "float32")
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, cpu) == name


def test_a_runner_loads_auto_in_the_resolved_dtype(llama_dir) -> None:
    runner = ModelRunner(llama_dir, EngineConfig(dtype="auto", num_kv_blocks=16))
    expected = resolve_dtype("auto", torch.device("cpu"))
    assert runner.config.dtype == expected and str(runner.dtype) == f"torch.{expected}"
    assert runner.kv_caches[0][0].dtype == runner.dtype
