"""A row's pace over time (Timeline.progress) and auto's steady state against the best fixed row (eval/steady.py):
fast, no simulator."""

import pytest

from wamkit.eval.steady import settled_s, steady_lines, steady_round, steady_vs_best_fixed
from wamkit.eval.timeline import Timeline


def test_progress_bins_chunks_by_their_end_and_marks_the_last_episode_start():
    tl = Timeline(t_origin=100.0)
    tl.add("env/0", "reset", 100.0, 100.2)
    tl.add("env/1", "reset", 100.0, 100.3)
    for k in range(6):                   # env 0: a chunk every 0.3 s from 100.25
        tl.add("env/0", "sim", 100.25 + 0.3 * k, 100.45 + 0.3 * k)
    tl.add("env/1", "reset", 101.1, 101.2)   # env 1's second episode: the last to begin
    tl.add("env/1", "sim", 101.2, 101.45)
    tl.add("request", "request", 101.45, 101.6)
    p = tl.progress()
    assert p["bin_s"] == 0.5 and p["wall_s"] == pytest.approx(1.95)
    # chunk ends (from 100.0): 0.45, 0.75, 1.05, 1.35, 1.65, 1.95 (env 0) and 1.45 (env 1); the last one falls in
    # the last bin (the run's end)
    assert p["chunks"] == [1, 1, 3, 2]
    assert sum(p["chunks"]) == 7
    assert p["tail_from_s"] == pytest.approx(1.1)
    assert Timeline().progress() == {}


def test_progress_widens_its_bins_for_long_runs():
    tl = Timeline(t_origin=0.0)
    tl.add("env/0", "reset", 0.0, 1.0)
    tl.add("env/0", "sim", 1.0, 1000.0)
    p = tl.progress()
    assert p["bin_s"] == 5.0 and len(p["chunks"]) == 201   # 1000 s: 0.5, 1 and 2 s bins would be over 400


def _progress(chunks, tail_from_s, bin_s=1.0):
    return {"bin_s": bin_s, "chunks": list(chunks), "tail_from_s": tail_from_s, "wall_s": len(chunks) * bin_s}


def test_steady_round_separates_the_probe_cost_from_the_steady_pace():
    fixed = _progress([100] * 20, tail_from_s=17.0)
    # auto: 3 s of probe at 80 chunks/s, then the fixed row's pace; its tail starts later
    auto = _progress([80, 80, 80] + [100] * 18, tail_from_s=18.0)
    r = steady_round(auto, fixed, settled=2.6)
    assert (r["from_s"], r["to_s"]) == (3.0, 17.0)        # the first whole bin after 2.6 s, to the earlier tail
    assert r["steady_ratio"] == pytest.approx(1.0)
    assert r["probe_cost_s"] == pytest.approx(60 / 100)  # 60 chunks fewer, at the fixed row's 100 a second
    assert r["tail_s"] == [3.0, 3.0]
    # a steady state 5% slower shows as such, whatever the probe cost
    slow = _progress([100, 100, 100] + [95] * 18, tail_from_s=18.0)
    r = steady_round(slow, fixed, settled=2.6)
    assert r["steady_ratio"] == pytest.approx(0.95) and r["probe_cost_s"] == pytest.approx(0.0)
    # unprobed (settled None): from the first bin
    assert steady_round(slow, fixed, None)["from_s"] == 0.0
    # bins that differ, no span left, or nothing to compare: None
    assert steady_round(auto, _progress([100] * 20, 17.0, bin_s=0.5), 2.6) is None
    assert steady_round(auto, fixed, settled=16.5) is None
    assert steady_round({}, fixed, 2.6) is None


def test_settled_is_the_first_decision_or_its_recheck():
    assert settled_s(None) is None and settled_s({"rounds": []}) is None
    first = {"at_s": 2.5, "active": 32, "chosen": "greedy"}
    assert settled_s({"rounds": [first]}) == 2.5
    # a later round on the tail (fewer envs) is not the first decision; a recheck the first one started is
    assert settled_s({"rounds": [first, {"at_s": 19.0, "active": 20, "chosen": "lockstep"}]}) == 2.5
    assert settled_s({"rounds": [first, {"at_s": 4.1, "active": 32, "chosen": "halves", "recheck": True}]}) == 4.1


def test_steady_vs_best_fixed_over_rounds_takes_each_rounds_own_decision():
    fixed = {"row": "B=1, P=32", "progress_rounds": [_progress([100] * 20, 17.0)] * 3}
    auto = {"row": "auto",
            "progress_rounds": [_progress([80] * 3 + [r] * 17, 18.0) for r in (90, 100, 97)],
            "auto_shape_rounds": [{"rounds": [{"at_s": 2.5, "active": 32}]},
                                  {"rounds": [{"at_s": 2.5, "active": 32}]},
                                  None]}                  # round 3 unprobed: compared from its first bin
    out = steady_vs_best_fixed([fixed, auto], {"auto": "B=1, P=32"})["auto"]
    assert [r["round"] for r in out["rounds"]] == [1, 2, 3]
    assert [r["steady_ratio"] for r in out["rounds"]] == pytest.approx([0.9, 1.0, (3 * 80 + 14 * 97) / 1700])
    assert out["steady_ratio"] == pytest.approx(0.94)   # the median of the three (round 3: 1598 / 1700)
    assert out["rounds"][2]["from_s"] == 0.0
    line, = steady_lines({"auto": out})
    assert "0.940 of B=1, P=32's pace" in line and "round 3:" in line
    # a single run (rounds=1) keeps its progress and auto_shape under their own keys
    single = steady_vs_best_fixed([{"row": "B=1, P=32", "progress": _progress([100] * 20, 17.0)},
                                   {"row": "auto", "progress": _progress([100] * 20, 17.0),
                                    "auto_shape": {"rounds": [{"at_s": 1.2, "active": 32}]}}], {"auto": "B=1, P=32"})
    assert single["auto"]["steady_ratio"] == pytest.approx(1.0)
    assert steady_vs_best_fixed([fixed], {"auto": "B=1, P=32"}) == {}
