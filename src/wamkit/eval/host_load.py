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


# the CPU controller's counters of this process's cgroup: v2 (one file, microseconds), else v1 (nanoseconds)
_CPU_STAT = (("/sys/fs/cgroup/cpu.stat", "throttled_usec", 1e-6),
             ("/sys/fs/cgroup/cpu/cpu.stat", "throttled_time", 1e-9))


def cgroup_throttling(stat: str | None = None, key: str = "throttled_usec", scale: float = 1e-6) -> dict | None:
    """How often and how long the cgroup's CPU quota (CFS bandwidth) has stopped this container's processes so far:
    {"periods": nr_throttled, "seconds": time throttled}, from cpu.stat (or `stat`, its text, with its time key and
    the key's unit in seconds); None where there is no such file. A quota stops every process of the container at
    once until the next period (100 ms by default): an evaluating process then misses its timers while its loop
    waits in select, which bench eval cannot tell from its own CPU shares."""
    if stat is None:
        for path, k, sc in _CPU_STAT:
            try:
                text = Path(path).read_text()
            except OSError:
                continue
            return cgroup_throttling(text, k, sc)
        return None
    vals = dict(line.split()[:2] for line in stat.splitlines() if len(line.split()) >= 2)
    if "nr_throttled" not in vals or key not in vals:
        return None
    return {"periods": int(vals["nr_throttled"]), "seconds": round(int(vals[key]) * scale, 6)}


def throttled(before: dict | None, after: dict | None) -> dict | None:
    """Between two cgroup_throttling readings: {"periods", "seconds"} throttled; None where either is missing."""
    if not before or not after:
        return None
    return {"periods": after["periods"] - before["periods"], "seconds": round(after["seconds"] - before["seconds"], 4)}
