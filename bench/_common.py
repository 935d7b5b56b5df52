"""Helpers shared by the bench/ scripts (they run as scripts: `python bench/x.py` puts bench/ on sys.path)."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine line of a results file."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
