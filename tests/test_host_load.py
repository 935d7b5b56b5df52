"""eval/host_load.py: CPU busy and steal shares from /proc/stat, as bench eval records them per row."""

from __future__ import annotations

import pytest

from wamkit.eval.host_load import cpu_times, shares

BEFORE = "cpu  1000 0 200 5000 100 0 10 40 0 0\ncpu0 500 0 100 2500 50 0 5 20 0 0\nintr 1\n"
AFTER = "cpu  1600 0 300 5200 100 0 10 90 0 0\ncpu0 800 0 150 2600 50 0 5 45 0 0\nintr 2\n"


def test_busy_and_stolen_shares_of_all_cpu_time():
    a, b = cpu_times(BEFORE), cpu_times(AFTER)
    assert a == {"user": 1000, "nice": 0, "system": 200, "idle": 5000, "iowait": 100, "irq": 0, "softirq": 10,
                 "steal": 40}
    # 950 ticks passed: 700 working (600 user + 100 system), 50 stolen, 200 idle
    assert shares(a, b) == {"busy": round(700 / 950, 4), "steal": round(50 / 950, 4)}
    assert shares(a, a) is None and shares(None, b) is None and cpu_times("intr 1\n") is None


def test_this_host_reads():
    a = cpu_times()
    if a is None:
        pytest.skip("no /proc/stat here")
    sum(range(2_000_000))   # some work, so that time passes
    s = shares(a, cpu_times())
    assert s is not None and 0.0 <= s["steal"] <= 1.0 and 0.0 <= s["busy"] <= 1.0
