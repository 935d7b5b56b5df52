"""Running a GPU kernel's code from a test on this CPU: a subprocess with the Triton that `make test` installs into
.cache/triton-site (the CPU torch wheel ships none) on its path, in Triton's CPU interpreter (TRITON_INTERPRET=1) or
not (to compile the kernels ahead of time for a GPU that is not here: Triton's wheel carries ptxas)."""

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


def interpret(script: str, *args: str, timeout: float = 300, interpreter: bool = True) -> subprocess.CompletedProcess:
    """`python -c script args...` with that Triton and src/ on its path; TRITON_INTERPRET=1 unless interpreter is
    False."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON_SITE), str(ROOT / "src")])
    if interpreter:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
