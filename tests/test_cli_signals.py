"""SIGTERM of a running `wamkit eval` (a real subprocess on a small MetaWorld plan): exit 143 with one line, no
traceback, every env worker process gone, no shared-memory segment left behind, the journal intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import running

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        pytest.skip("pgrep not available")
    return [int(x) for x in out.split()]


def _shm() -> set[str]:
    d = Path("/dev/shm")
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _mapped_shm(pid: int) -> set[str]:
    """Shared-memory segments a process has mapped (the env workers' image buffers, in the eval process)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        pytest.skip("no /proc")
    return {line.rsplit("/", 1)[-1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line}


@pytest.mark.slow
@pytest.mark.metaworld
def test_sigterm_of_eval_exits_cleanly(tmp_path):
    pytest.importorskip("metaworld")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "LP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "wamkit.cli.main", "eval", "env=metaworld", "env_args.tasks=reach-v3", "trials=40",
           "policy=zero", "max_steps=100", "image_size=64", "mode=auto", "num_envs=2", f"out={out}"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (out / "results.jsonl").exists():   # the plan is running
            assert p.poll() is None, p.communicate()
            time.sleep(0.2)
        assert (out / "results.jsonl").exists(), "the eval did not start"
        workers = _children(p.pid)
        mine = _mapped_shm(p.pid)                    # this run's shared-memory buffers (one per env worker)
        assert workers and len(mine) == 2, mine
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, stderr
    assert "Traceback" not in stderr and "leaked" not in stderr, stderr
    assert "terminated (SIGTERM)" in stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(w) for w in workers):
        time.sleep(0.2)
    assert not [w for w in workers if running(w)], "env worker processes outlived the eval"
    assert not (mine & _shm()), "shared memory left behind"
    # what finished before the signal is in the journal, whole lines only (resume=true continues from there)
    import json

    for line in (out / "results.jsonl").read_text().splitlines():
        json.loads(line)


def test_asyncio_s_report_of_the_unwinding_exception_is_dropped_and_nothing_else():
    """The 'Task exception was never retrieved' record asyncio writes for a main task that ended holding Terminated
    (SIGTERM landed while it ran) is dropped; any other exception's record is kept."""
    import logging

    from wamkit.cli.main import Terminated, drop_terminated

    def record(exc):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", None,
                                 (type(exc), exc, None))

    assert drop_terminated(record(Terminated())) is False
    assert drop_terminated(record(RuntimeError("real"))) is True
    assert drop_terminated(record(KeyboardInterrupt())) is True
    assert drop_terminated(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "no exception", None, None))
