"""Running a GPU kernel's code in Triton's CPU interpreter from a test: a subprocess with TRITON_INTERPRET=1 and the
Triton that `make test` installs into .cache/triton-site (the CPU torch wheel ships none) on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRITON_SITE = ROOT / ".cache" / "triton-site"

needs_interpreter = pytest.mark.skipif(
    not (TRITON_SITE / "triton").is_dir(),
    reason="needs Triton for its CPU interpreter in .cache/triton-site (make test installs it)")


def interpret(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c script args...` with TRITON_INTERPRET=1 and the interpreter's Triton and src/ on its path."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TRITON_SITE), str(ROOT / "src")])}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
