"""How `workers.runner.native` builds: a lock left by a killed build or start hangs no later one."""

import os
import time
from pathlib import Path

from workers.runner import native


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    native._clear_stale_lock(tmp_path)
    assert not lock.exists()
    native._clear_stale_lock(tmp_path)  # and nothing to remove is fine


def test_switched_off_by_the_environment(monkeypatch):
    for off in ("0", "false", "off"):
        monkeypatch.setenv(native.DISABLE_ENV, off)
        assert not native.enabled()
        assert native.fused_ops() is None
        assert native.decode_attention() is None
        assert native.prefill_attention("bfloat16", 64) is None
        assert not native.build_all()
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    assert native.enabled()


def test_a_built_kernel_is_loaded_past_any_build_lock():
    """torch's `load` takes the build lock even to find a build up to date; a worker killed
    there left a lock that hung every later start. A kernel that is built is loaded
    (`_build`, the path every worker takes) whatever lock lies beside it."""
    import threading

    from torch.utils.cpp_extension import _get_build_directory

    assert native.fused_ops() is not None  # built (scripts/setup.sh builds them ahead)
    name = native._module_name("fused_ops")
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()  # as a killed start leaves it: fresh, so not cleared as stale
    loaded = []
    try:  # uncached, as a new worker process calls it; in a thread: the old path hung
        worker = threading.Thread(
            target=lambda: loaded.append(native._build.__wrapped__("fused_ops")), daemon=True
        )
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "loading a built kernel waited on the build lock"
    finally:
        lock.unlink(missing_ok=True)
    assert loaded and hasattr(loaded[0], "silu_mul")
    assert native._import_built(name + "_never_built", lock.parent) is None


def test_a_kernel_is_named_after_its_source(tmp_path, monkeypatch):
    """A build of older source is never imported for the current one."""
    before = native._module_name("fused_ops")
    source = (native.SOURCE_DIR / "fused_ops.cpp").read_text()
    (tmp_path / "fused_ops.cpp").write_text(source + "\n// changed\n")
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    after = native._module_name("fused_ops")
    assert after != before and after.startswith("switchyard_fused_ops_")
