"""Where the CPU kernels are built: one folder per checkout, and no wait on a dead build's lock."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvserve.kernels import build


def test_another_checkout_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    here = build.build_dir()
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in build.CSRC.glob("*.[ch]*"):
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "CSRC", copy)
    assert build.build_dir() != here  # same sources elsewhere: ninja names them by path


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path: Path):
    lock = tmp_path / "lock"
    lock.touch()
    build._remove_stale_lock(lock)
    assert lock.exists()  # a build may be running
    old = time.time() - build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    build._remove_stale_lock(lock)
    assert not lock.exists()
    build._remove_stale_lock(lock)  # no lock: nothing to do
