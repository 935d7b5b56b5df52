"""core.shm_names: the one "owner gone" test (dead, or its pid reused) and the /dev/shm sweep that uses it."""

from __future__ import annotations

import os
import subprocess
import sys

from wamkit.core.shm_names import owned_name, owner_gone, process_start, sweep_orphans


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_owner_gone_when_dead_or_reused_never_this_process():
    parent = os.getppid()
    assert owner_gone(_dead_pid())
    assert owner_gone(parent, "1")                        # the pid runs, but started at another time: reused
    assert not owner_gone(parent)
    assert not owner_gone(parent, process_start(parent))
    assert not owner_gone(os.getpid(), "1")


def test_sweep_removes_only_files_of_dead_pids(tmp_path):
    dead = f"wktest-{_dead_pid()}_{'0' * 24}"
    live = owned_name("wktest-")
    other = f"other-{_dead_pid()}_{'0' * 24}"
    for name in (dead, live, other):
        (tmp_path / name).write_bytes(b"")
    assert sweep_orphans("wktest-", str(tmp_path)) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, other])
