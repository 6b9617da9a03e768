"""How `workers.native` builds: a lock left by a killed build does not hang the next one."""

import os
import time

from workers import native


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
