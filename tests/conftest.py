"""Shared pytest setup: headless rendering defaults for simulator tests, and the fixtures kept in the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"] if os.environ["MUJOCO_GL"] == "osmesa" else "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")

FIXTURES = Path(__file__).resolve().parent / "fixtures"   # data written by other tools (LeRobot), kept in the repo
LIBERO_TINY = FIXTURES / "lerobot_v3_libero_tiny"


@pytest.fixture(autouse=True, scope="module")
def _free_garbage_in_the_main_thread():
    """At each module's end, free the reference cycles its tests left (a closed LIBERO env's MjSim, compiled graphs,
    policies) here, in the main thread. Left to the cyclic GC they are freed by whichever thread allocates next, e.g.
    a predict thread of a later test, running C destructors there while it holds the GIL."""
    yield
    import gc

    gc.collect()


# In-process MuJoCo renderers hold EGL contexts whose destructors can crash (SIGSEGV) during interpreter teardown, after
# every test has passed and the summary is printed. Once pytest is done, leave with its exit status and skip teardown
# (every test fixture and worker process has already been closed by then).
_EXIT_STATUS: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _EXIT_STATUS and os.environ.get("WAMKIT_PYTEST_HARD_EXIT", "1") == "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[0])
