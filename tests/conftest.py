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
