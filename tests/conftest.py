"""Shared pytest setup: headless rendering defaults for simulator tests, and the ../shared path helper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"] if os.environ["MUJOCO_GL"] == "osmesa" else "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path under the project's shared directory (../shared from the repository root)."""
    return SHARED_DIR.joinpath(*parts)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return SHARED_DIR


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
