"""Helpers shared by the bench/ scripts (they run as scripts: `python bench/x.py` puts bench/ on sys.path)."""

from __future__ import annotations

import json
import os
import platform
import time


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine line of a results file."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_cases_json(path: str, meta: dict, rows: list[dict]) -> None:
    """A results file of one bench script run: this machine's CPUs and kernel, the date, `meta` (the run's
    arguments) and its rows (one per case). Nothing is written for an empty path."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"cpus": len(os.sched_getaffinity(0)), "kernel": os.uname().release, **meta,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}, f, indent=1)
