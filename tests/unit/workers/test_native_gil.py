"""The native kernels let go of the GIL while they run.

The engine steps in its own thread beside the worker's HTTP event loop; a kernel that held
the GIL for the whole of a long prompt's linear layers (tens of milliseconds each) stopped
the server streaming tokens, answering health checks and taking requests meanwhile."""

import re
import threading
import time

import pytest
import torch

from workers import native

# Entry points that only answer a question or move a weight once at load.
AT_LOAD = {"supports", "pack", "pack_gated", "unpack"}


def test_every_kernel_entry_point_releases_the_gil():
    for path in sorted(native.SOURCE_DIR.glob("*.cpp")):
        text = path.read_text()
        defs = re.findall(r'm\.def\("(\w+)",(.*?)\);', text, flags=re.S)
        assert defs, path
        for name, rest in defs:
            if name not in AT_LOAD:
                assert "gil_scoped_release" in rest, f"{path.name}: {name} holds the GIL"


def _longest_stall(call) -> tuple[float, float]:
    """Runs `call` in a thread while this one keeps stamping the time: how long until the
    call was done, and the longest gap between two stamps meanwhile."""
    done = threading.Event()

    def run():
        call()
        done.set()

    worker = threading.Thread(target=run)
    stamps = [time.perf_counter()]
    worker.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
    worker.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[-1] - stamps[0], max(gaps, default=0.0)


def _linear():
    kernel = native.linear("float32")
    if kernel is None:
        pytest.skip("no native linear kernel on this CPU")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 4096, generator=gen)
    w = kernel.pack(torch.randn(4096, 4096, generator=gen))
    return lambda: kernel.linear(x, w)


def _prefill():
    kernel = native.prefill_attention("float32", 64)
    if kernel is None:
        pytest.skip("no native prompt-attention kernel on this CPU")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3072, 16, 64, generator=gen)
    k, v = torch.randn(2, 3072, 4, 64, generator=gen)
    out = torch.empty_like(q)
    return lambda: kernel(q, k, v, 0.125, out)


@pytest.mark.parametrize("make", [_linear, _prefill], ids=["linear", "prefill_attention"])
def test_python_runs_while_a_kernel_does(make):
    call = make()
    took, stall = _longest_stall(call)
    assert took > 0.05, "the call is too short to tell"
    # Holding the GIL, this thread would stand still for the whole call.
    assert stall < took / 3, (took, stall)
