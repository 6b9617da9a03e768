"""Large CPU buffers on transparent huge pages (`workers.runner.memory`)."""

import itertools
import re
from pathlib import Path

import pytest
import torch

from workers.runner.memory import HUGE_PAGE, HugeArena, cpu_zeros, huge_pages_available, zeros


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    text = Path("/proc/self/smaps").read_text()
    inside = False
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_large_buffer_is_zeroed_contiguous_and_aligned_to_a_huge_page():
    t = cpu_zeros((4, 3, 4096, 64), torch.bfloat16)  # 6 MiB
    assert t.shape == (4, 3, 4096, 64) and t.dtype == torch.bfloat16
    assert t.is_contiguous() and not t.any()
    if huge_pages_available():
        assert t.data_ptr() % HUGE_PAGE == 0
    t[3, 2, 4095, 63] = 1.5  # the whole extent is writable
    assert t.sum().item() == 1.5


def test_a_small_buffer_is_plain_torch_memory():
    t = cpu_zeros((16, 64), torch.float32)
    assert t.shape == (16, 64) and not t.any()
    assert zeros((2, 8), torch.float32, torch.device("cpu")).shape == (2, 8)


@pytest.mark.skipif(
    _thp_mode() not in ("always", "madvise") or not huge_pages_available(),
    reason="this kernel offers no transparent huge pages to an madvise",
)
def test_the_buffer_is_on_huge_pages_faulted_in_before_it_is_returned():
    t = cpu_zeros((8 * HUGE_PAGE // 4,), torch.float32)  # 8 huge pages
    # Faulted in already: left to the first touch, the engine's steps paid for it.
    assert _huge_kib_at(t.data_ptr()) >= 2048


def test_an_arena_holds_copies_aligned_and_equal():
    tensors = [torch.randn(100, 33), torch.randn(3, 2, 5).to(torch.bfloat16), torch.randn(7)]
    arena = HugeArena(tensors)
    copies = [arena.copy(t) for t in tensors]
    for src, dst in zip(tensors, copies, strict=True):
        assert torch.equal(src, dst) and dst.dtype == src.dtype and dst.is_contiguous()
        assert dst.data_ptr() % HugeArena.ALIGN == 0
    ends = [(c.data_ptr(), c.data_ptr() + c.nbytes) for c in copies]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))
    with pytest.raises(AssertionError, match="not sized"):
        arena.copy(torch.randn(1024))
