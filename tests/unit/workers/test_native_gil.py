"""The native kernels keep the GIL while they run (see `workers/runner/native/__init__.py`).

Releasing it let the worker's event loop take a core from one of a kernel's OpenMP
threads on this 2-core machine: the worker over HTTP fell from 629 to 524 tok/s in
`switchyard bench worker`. A change that releases it again must come with a new measure,
and this test changed with it."""

import re

from workers.runner import native


def test_no_kernel_entry_point_releases_the_gil():
    defs = 0
    for path in sorted(native.SOURCE_DIR.glob("*.cpp")):
        text = path.read_text()
        found = re.findall(r'm\.def\("(\w+)",(.*?)\);', text, flags=re.S)
        assert found, f"{path.name}: no entry points found (did the binding style change?)"
        defs += len(found)
        for name, rest in found:
            assert "gil_scoped_release" not in rest, f"{path.name}: {name}"
    assert defs >= 12
