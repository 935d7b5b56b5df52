"""How busy this host's CPUs were during a run, from /proc/stat (Linux): the share of CPU time spent working, and
the share *stolen* by the hypervisor for other guests (a virtual machine's noisy neighbours). `bench eval` records
both per row: on the GPU machine rows of one setting moved by ~10% between calls (session 16), and steal time is
one cause a row can see but not control."""

from __future__ import annotations

from pathlib import Path

# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal (guest time is inside user)
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: str | None = None) -> dict[str, int] | None:
    """The aggregate CPU times (clock ticks) of /proc/stat, or of `stat` (its text); None where there is none."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            vals = [int(x) for x in parts[1:1 + len(_FIELDS)]]
            return dict(zip(_FIELDS, vals + [0] * (len(_FIELDS) - len(vals))))
    return None


def shares(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float] | None:
    """Between two cpu_times readings: {"busy": working share, "steal": stolen share} of all CPU time (idle and
    iowait make up the rest); None where either reading is missing or no time passed."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in _FIELDS}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
    return {"busy": round(busy / total, 4), "steal": round(d["steal"] / total, 4)}
