"""A shard group placed on cores of its own gives each rank its own slice of them."""

import os
import subprocess
import sys

from workers.tp.launch import rank_cpus


def test_the_groups_cores_split_into_adjacent_slices_one_per_rank(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {9, 2, 3, 4, 5})
    assert rank_cpus(2) == [[2, 3], [4, 5]]  # the fifth core is left over, unused
    assert rank_cpus(5) == [[2], [3], [4], [5], [9]]
    assert rank_cpus(6) is None  # fewer cores than ranks: nothing to split


def test_a_rank_pins_itself_to_its_slice():
    cores = sorted(os.sched_getaffinity(0))
    code = (
        "import os; from workers.tp.launch import pin_to, rank_cpus; "
        "s = rank_cpus(len(os.sched_getaffinity(0))); pin_to(s[-1]); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([cores[-1]])
