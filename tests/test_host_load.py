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


def test_cgroup_throttling_in_both_cpu_stat_forms():
    """cgroup v2's cpu.stat (microseconds) and v1's (nanoseconds): periods throttled and seconds, and their
    difference over a row; no counters, no figure."""
    from wamkit.eval.host_load import cgroup_throttling, throttled

    v2a = "usage_usec 100\nuser_usec 60\nsystem_usec 40\nnr_periods 50\nnr_throttled 3\nthrottled_usec 250000\n"
    v2b = "usage_usec 900\nuser_usec 600\nsystem_usec 300\nnr_periods 90\nnr_throttled 11\nthrottled_usec 1050000\n"
    a, b = cgroup_throttling(v2a), cgroup_throttling(v2b)
    assert a == {"periods": 3, "seconds": 0.25} and throttled(a, b) == {"periods": 8, "seconds": 0.8}
    v1 = "nr_periods 7\nnr_throttled 2\nthrottled_time 300000000\n"
    assert cgroup_throttling(v1, "throttled_time", 1e-9) == {"periods": 2, "seconds": 0.3}
    assert cgroup_throttling("nr_periods 0\n") is None and throttled(None, b) is None


def test_this_hosts_cgroup_reads_if_it_has_one():
    from wamkit.eval.host_load import cgroup_throttling

    t = cgroup_throttling()
    if t is None:
        pytest.skip("no cgroup cpu.stat here")
    assert t["periods"] >= 0 and t["seconds"] >= 0.0
