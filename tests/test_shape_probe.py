"""auto's measured choice of request shape (eval/shape_probe.py): the bookkeeping on synthetic answer streams, and
the planner using it on modelled costs (bench/planner_sim.py: the real Scheduler on a virtual clock)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from wamkit.eval import scheduler as scheduler_mod
from wamkit.eval.shape_probe import GREEDY, HALVES, LOCKSTEP, PLAN, ShapeProbe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import planner_sim as ps  # noqa: E402


def drive(probe: ShapeProbe, answers, until: float, active=lambda t: 8, cycle=0.05, remaining=100.0):
    """Feed the probe the answers of whichever shape it uses: answers[shape](t0, t1) -> observations answered in
    [t0, t1). Ticks of 1 ms; returns the seconds spent in each shape."""
    spent = {shape: 0.0 for shape in answers}
    t, dt = 0.0, 0.001
    while t < until:
        n = answers[probe.current](t, t + dt)
        spent[probe.current] += dt
        if n:
            probe.answered(t + dt, n, cycle, active(t), remaining)
        t += dt
    return spent


def steady(rate: float):
    """`rate` observations per second, one at a time."""
    return lambda t0, t1: int(t1 * rate) - int(t0 * rate)


def lumps(size: int, period: float):
    """`size` observations at once every `period` seconds (a cohort answered together)."""
    return lambda t0, t1: size * (int(t1 / period) - int(t0 / period))


def test_the_faster_shape_is_kept_and_its_rate_is_measured():
    p = ShapeProbe((PLAN, GREEDY))
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=3.0)
    assert len(p.rounds) == 1 and p.current == GREEDY
    rates = p.rounds[0].rates
    assert rates[PLAN] == pytest.approx(100.0, rel=0.05) and rates[GREEDY] == pytest.approx(150.0, rel=0.05)


def drifting(before: float, after: float, at: float):
    """`before` observations per second until `at` seconds, `after` from then on (a shape whose first window
    happened to run fast: the noise one window per shape cannot average out)."""
    def count(t: float) -> int:
        return int(before * min(t, at) + after * max(0.0, t - at))
    return lambda t0, t1: count(t1) - count(t0)


def test_a_close_call_is_settled_by_a_duel_over_more_windows():
    """greedy's round window runs at 106/s, halves' at 102/s (within CLOSE): one window each would keep greedy,
    whose rate from then on is 98/s. The duel alternates the two for DUEL_LEGS more windows and keeps halves,
    which is faster over all their windows; neither duel leg is cut short by the early stop."""
    p = ShapeProbe((GREEDY, HALVES))
    spent = drive(p, {GREEDY: drifting(106.0, 98.0, 1.0), HALVES: steady(102.0)}, until=6.0)
    assert len(p.rounds) == 1, p.summary()
    r = p.rounds[0]
    assert r.rates[GREEDY] > r.rates[HALVES] > (1 - ShapeProbe.CLOSE) * r.rates[GREEDY]   # the round alone: greedy
    assert set(r.duel) == {GREEDY, HALVES} and r.chosen == HALVES and p.current == HALVES
    legs = 1 + ShapeProbe.DUEL_LEGS // 2   # each shape's round window and its half of the duel's
    assert r.duel[GREEDY] == pytest.approx((106.0 + (legs - 1) * 98.0) / legs, rel=0.03)   # its windows pooled
    assert r.duel[HALVES] == pytest.approx(102.0, rel=0.03)
    window = max(ShapeProbe.MIN_WINDOW_S, ShapeProbe.WINDOW_CYCLES * 0.05)
    assert spent[GREEDY] >= legs * window and "duel_obs_per_s" in p.summary()[0]


def test_a_seven_percent_lead_in_one_window_is_dueled(monkeypatch):
    """Session 20's 16-env round on an H100: halves' one window ran at 420/s and greedy's at 391/s (7% apart),
    while over the row greedy's shape ran at ~410/s and halves' at ~385/s (a 0.4 s window varies 7-11% there). The
    duel (any call within CLOSE = 15%) pools five windows per shape and keeps greedy; with the old CLOSE of 5% the
    round's single windows would have kept halves."""
    stream = {GREEDY: drifting(391.0, 410.0, 0.5), HALVES: drifting(420.0, 385.0, 1.1)}
    p = ShapeProbe((GREEDY, HALVES))
    drive(p, stream, until=8.0)
    r = p.rounds[0]
    assert r.rates[HALVES] > 1.05 * r.rates[GREEDY] and r.duel, p.summary()
    assert r.chosen == GREEDY and p.current == GREEDY
    monkeypatch.setattr(ShapeProbe, "CLOSE", 0.05)
    p = ShapeProbe((GREEDY, HALVES))
    drive(p, stream, until=8.0)
    assert p.rounds[0].duel == {} and p.current == HALVES


def slowed(rate: float, slow: float, start: float, end: float):
    """`rate` observations per second except `slow` in [start, end) (a transient: the host busy for a while)."""
    def count(t: float) -> int:
        return int(rate * min(t, start) + slow * max(0.0, min(t, end) - start) + rate * max(0.0, t - end))
    return lambda t0, t1: count(t1) - count(t0)


def test_a_decision_the_run_then_contradicts_is_checked_and_measured_again(monkeypatch):
    """Session 16's H100 round: the plan's window ran fast (480/s, then 400 for good) while a transient slowed
    halves' window (300 of its 460, so the early stop cut it short): the round keeps the plan. Its check window (the
    next one of the plan, 400/s, more than CHECK_DROP below 480, with a rival cut short) starts a recheck, which
    measures every shape again and keeps halves; the recheck's own decision is not checked again."""
    stream = {PLAN: drifting(480.0, 400.0, 0.5), GREEDY: steady(380.0), HALVES: slowed(460.0, 300.0, 0.5, 1.6)}
    p = ShapeProbe((PLAN, GREEDY, HALVES))
    drive(p, stream, until=8.0)
    assert [r.chosen for r in p.rounds] == [PLAN, HALVES] and p.current == HALVES, p.summary()
    first, second = p.rounds
    assert first.rates[HALVES] < 0.75 * 460.0 and first.check == pytest.approx(400.0, rel=0.05)
    assert not first.recheck and second.recheck and second.check is None
    assert second.rates[PLAN] == pytest.approx(400.0, rel=0.05) and second.rates[HALVES] == pytest.approx(460.0, rel=0.05)
    assert p.summary()[0]["check_obs_per_s"] == pytest.approx(400.0, rel=0.05) and p.summary()[1]["recheck"]
    # without the check the round's decision stands for the rest of the run
    monkeypatch.setattr(ShapeProbe, "CHECK_DROP", 1.0)
    p = ShapeProbe((PLAN, GREEDY, HALVES))
    drive(p, stream, until=8.0)
    assert [r.chosen for r in p.rounds] == [PLAN] and p.current == PLAN


def test_a_check_that_fails_with_no_rival_cut_short_keeps_the_decision(monkeypatch):
    """halves kept at 500/s over plan (400) and greedy (380) (apart enough for no duel), each measured over a whole window; then a slowdown in
    halves' check window (300/s). No rival's window was cut short, so nothing says the round was skewed: no recheck.
    On the drop alone a recheck would run while the slowdown lasts, measure halves at ~300 and keep the plan for
    the rest of the run (what made that rule lose on the planner model)."""
    stream = {PLAN: steady(400.0), GREEDY: steady(380.0), HALVES: slowed(500.0, 300.0, 1.55, 2.6)}
    p = ShapeProbe((PLAN, GREEDY, HALVES))
    drive(p, stream, until=8.0)
    assert [r.chosen for r in p.rounds] == [HALVES] and p.current == HALVES, p.summary()
    assert p.rounds[0].check < (1 - ShapeProbe.CHECK_DROP) * p.rounds[0].kept_rate   # the check did fail
    assert p.rounds[0].rates[GREEDY] > ShapeProbe.EARLY_STOP * 500.0
    monkeypatch.setattr(ShapeProbe, "CHECK_NEEDS_CUT", False)
    p = ShapeProbe((PLAN, GREEDY, HALVES))
    drive(p, stream, until=8.0)
    assert [r.chosen for r in p.rounds] == [HALVES, PLAN] and p.rounds[1].recheck and p.current == PLAN


def test_a_machine_that_slows_for_good_gets_one_recheck_not_a_loop():
    """Every shape 35% slower from 0.6 s on: the check fails once, the recheck measures the slower machine and its
    decision stands (no check of a recheck, no third round)."""
    stream = {PLAN: drifting(480.0, 312.0, 0.6), GREEDY: drifting(380.0, 247.0, 0.6),
              HALVES: drifting(440.0, 286.0, 0.6)}
    p = ShapeProbe((PLAN, GREEDY, HALVES))
    drive(p, stream, until=10.0)
    assert len(p.rounds) == 2 and p.rounds[1].recheck and p.current == p.rounds[1].chosen == PLAN, p.summary()


def test_no_duel_where_the_shapes_are_clearly_apart_or_the_run_cannot_pay_for_it():
    p = ShapeProbe((GREEDY, HALVES))
    drive(p, {GREEDY: steady(100.0), HALVES: steady(125.0)}, until=3.5)      # 20% apart: the round decides
    assert p.rounds[0].duel == {} and p.current == HALVES and "duel_obs_per_s" not in p.summary()[0]
    # 2% apart, but the rest of the run pays for the round (1 window) and not for the duel (DUEL_LEGS windows)
    one = (ShapeProbe.SETTLE_CYCLES + ShapeProbe.WINDOW_CYCLES) * 0.05
    rest = 2 * one / ShapeProbe.MAX_SHARE
    assert one <= ShapeProbe.MAX_SHARE * rest < ShapeProbe.DUEL_LEGS * one
    p = ShapeProbe((GREEDY, HALVES))
    drive(p, {GREEDY: steady(100.0), HALVES: steady(102.0)}, until=3.5, remaining=rest)
    assert len(p.rounds) == 1 and p.rounds[0].duel == {} and p.current == HALVES


def test_the_plan_is_kept_where_it_is_faster_and_a_clearly_slower_shape_stops_early():
    p = ShapeProbe((PLAN, GREEDY))
    spent = drive(p, {PLAN: steady(150.0), GREEDY: steady(60.0)}, until=3.0)
    assert p.current == PLAN and p.rounds[0].chosen == PLAN
    window = ShapeProbe.SETTLE_CYCLES * 0.05 + max(ShapeProbe.MIN_WINDOW_S, ShapeProbe.WINDOW_CYCLES * 0.05)
    assert spent[GREEDY] < 0.6 * window      # 60 < 0.7 x 150 a quarter into its window: stopped there


def test_answers_in_lumps_are_counted_whole_at_both_ends():
    """A shape that answers a cohort at a time (16 every 0.1 s = 160/s) against one that answers 150/s one at a
    time: where the window's edges fall inside a lump's period must not decide (counting from the window's opening
    instead of the first answer after it would credit up to a whole extra lump: 200/s for some phases)."""
    for phase in [i * 0.01 for i in range(10)]:
        p = ShapeProbe((PLAN, GREEDY))
        lump = lumps(16, 0.1)
        drive(p, {PLAN: steady(150.0), GREEDY: lambda t0, t1: lump(t0 + phase, t1 + phase)}, until=6.0)
        assert p.current == GREEDY, phase
        assert p.rounds[0].rates[GREEDY] == pytest.approx(160.0, rel=0.05), (phase, p.rounds[0].rates)


def test_no_round_before_the_rest_of_the_run_is_known_or_where_it_cannot_pay_back():
    """A round costs the settle + window cycles of every shape but the one in use (measured first, unsettled)."""
    p = ShapeProbe((PLAN, GREEDY))
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=2.0, remaining=None)
    assert p.rounds == [] and p.current == PLAN
    cost = 1 * (ShapeProbe.SETTLE_CYCLES + ShapeProbe.WINDOW_CYCLES) * 0.05
    p = ShapeProbe((PLAN, GREEDY))
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=2.0, remaining=cost / ShapeProbe.MAX_SHARE * 0.9)
    assert p.rounds == [] and p.current == PLAN
    p = ShapeProbe((PLAN, GREEDY))
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=2.0, remaining=cost / ShapeProbe.MAX_SHARE * 1.1)
    assert len(p.rounds) == 1


def test_measured_again_when_the_active_envs_fall_well_below_the_last_round():
    p = ShapeProbe((PLAN, GREEDY))
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=3.0, active=lambda t: 8)
    assert len(p.rounds) == 1
    # the same envs for longer: no new round (REPROBE_S is far away)
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=2.0, active=lambda t: 7)
    assert len(p.rounds) == 1
    # the tail: 5 of 8 envs left, and now the plan is the faster one
    drive(p, {PLAN: steady(90.0), GREEDY: steady(40.0)}, until=3.0, active=lambda t: 5)
    assert len(p.rounds) == 2 and p.rounds[1].active == 5 and p.current == PLAN
    assert p.rounds[1].as_dict()["chosen"] == PLAN


def test_four_shapes_the_fastest_kept_and_each_measured_once():
    """The default shapes: the plan, greedy, lockstep (one request of every env, answered as one lump a cycle) and
    halves (two requests of half the envs each, one lump per half-cycle); the two fastest more than CLOSE apart."""
    p = ShapeProbe()
    assert p.shapes == (PLAN, GREEDY, LOCKSTEP, HALVES)
    spent = drive(p, {PLAN: steady(100.0), GREEDY: steady(110.0), LOCKSTEP: lumps(16, 0.1),
                      HALVES: lumps(8, 0.06)}, until=5.0)
    assert len(p.rounds) == 1 and p.current == LOCKSTEP and set(p.rounds[0].rates) == set(p.shapes)
    assert p.rounds[0].rates[LOCKSTEP] == pytest.approx(160.0, rel=0.05)
    assert p.rounds[0].rates[HALVES] == pytest.approx(8 / 0.06, rel=0.05)
    assert spent[GREEDY] < 1.5     # measured once: a window and its settling, not the rest of the run
    assert p.rounds[0].check == pytest.approx(160.0, rel=0.05)   # the kept shape held its rate: no second round


def test_one_env_is_never_probed():
    p = ShapeProbe((PLAN, GREEDY))
    drive(p, {PLAN: steady(100.0), GREEDY: steady(150.0)}, until=2.0, active=lambda t: 1)
    assert p.rounds == []


# ------------------------------------------------------------------ the planner with it, on modelled costs
HETERO = ps.Regime("hetero-16", 16, 16, 0.030, 0.012, 0.0002, net_s=0.002, jitter=0.1, chunks=20, episodes=256,
                   server_wait_s=0.0, task_cost=(0.5, 1.0, 1.5, 2.0))


@pytest.fixture
def planners(monkeypatch):
    made = []
    init = scheduler_mod.RequestPlanner.__init__

    def keep(self, sched):
        init(self, sched)
        made.append(self)

    monkeypatch.setattr(scheduler_mod.RequestPlanner, "__init__", keep)
    return made


def test_a_poor_plan_is_replaced_by_sending_at_once_where_the_server_merges(monkeypatch, planners):
    """The cost model's plan forced to lockstep (one request of every env) on envs whose tasks simulate at 0.5-2x:
    the probe measures both shapes, keeps greedy, and auto ends at the greedy row's rate, well above the plan's."""
    greedy_row = ps.run(HETERO, "pipelines", 1, 16)["env_steps_per_s"]
    lockstep_row = ps.run(HETERO, "pipelines", 16, 1)["env_steps_per_s"]
    monkeypatch.setattr(scheduler_mod.RequestPlanner, "plan", lambda self: (max(1, self.s.active_envs), 1))
    auto = ps.run(HETERO, "auto")["env_steps_per_s"]
    summary = planners[-1].shape_summary()
    assert summary["probed"] and summary["rounds"][0]["chosen"] == GREEDY and summary["shape"] == GREEDY
    assert lockstep_row < 0.85 * greedy_row            # the plan really is the poor one here
    assert auto >= 0.97 * greedy_row, (auto, greedy_row)


def test_auto_starts_greedy_where_a_chunk_lasts_many_calls_and_the_run_is_too_short_to_probe(monkeypatch, planners):
    """Session 31's LIBERO rows (bench/planner_sim.py gpu-libero-16-s31: a chunk ~0.3-0.45 s, a call ~35 ms, a
    merging server, 96 episodes: too few for a probe round): auto reads a chunk of over 5 calls and sends every
    observation at once, as the B=1, P=16 row does, and matches that row; held to the plan it batches (mean request
    over 1.3) and runs slower. Every episode runs once either way."""
    r = ps.REGIMES["gpu-libero-16-s31"]
    greedy_row = ps.run(r, "pipelines", 1, r.envs)
    auto = ps.run(r, "auto")
    pl = planners[-1]
    began = auto["auto_shape"]["began_with"]
    assert not auto["auto_shape"]["probed"] and auto["auto_shape"]["shape"] == GREEDY
    assert began["shape"] == GREEDY and began["chunk_ms"] > 5 * began["call_ms"], began
    assert {n for n, _ in list(pl.decisions)[r.envs:]} == {1}   # after the first requests, one observation each
    monkeypatch.setattr(scheduler_mod, "GREEDY_CHUNK_CALLS", 1e9)   # the rule off: the plan
    plan = ps.run(r, "auto")
    assert plan["auto_shape"]["began_with"]["shape"] == PLAN and plan["mean_batch"] > 1.3
    assert auto["env_steps_per_s"] >= 0.995 * greedy_row["env_steps_per_s"]
    assert auto["env_steps_per_s"] > plan["env_steps_per_s"]
    assert auto["episodes"] == plan["episodes"] == greedy_row["episodes"] == r.episodes


def test_auto_starts_with_the_plan_where_a_chunk_lasts_about_a_call(planners):
    """Session 10's MetaWorld costs (a chunk ~18 ms, a call ~33 ms): auto starts with the plan, and its probe, not
    the start rule, decides the shape (halves there)."""
    r = ps.REGIMES["gpu-metaworld-16-s10"]
    auto = ps.run(r, "auto")
    began = auto["auto_shape"]["began_with"]
    assert began["shape"] == PLAN and began["chunk_ms"] < 5 * began["call_ms"], began
    assert auto["auto_shape"]["probed"] and auto["auto_shape"]["rounds"][0]["rates_obs_per_s"]


def test_halves_is_kept_where_two_cohorts_overlap_and_never_has_more_than_two_requests_out(planners):
    """Session 10's H200 MetaWorld costs (a chunk ~22 ms, server compute ~22.5 ms flat in batch size, transport
    beside it; bench/planner_sim.py gpu-metaworld-16-s10): two half-size requests overlap one half's simulation with
    the other's inference, which neither lockstep (every env waits for the slowest, then for one call) nor greedy
    (batches of whoever waits, each paying the flat cost) does; the fixed row of that shape (B=8, P=2) is the grid's
    best there. auto measures halves, keeps it, and comes within 0.97 of that row (0.94 without the shape), each of
    its requests at most half the active envs, never more than two out at once, every episode run once."""
    r = ps.REGIMES["gpu-metaworld-16-s10"]
    rows = {label: ps.run(r, mode, b, p)["env_steps_per_s"] for label, mode, b, p in ps.grid_rows(r)
            if mode != "auto"}
    auto = ps.run(r, "auto")
    pl = planners[-1]
    summary = pl.shape_summary()
    assert summary["probed"] and summary["shape"] == HALVES, summary
    assert max(rows, key=rows.get) == "B=8, P=2"
    assert auto["env_steps_per_s"] >= 0.97 * rows["B=8, P=2"], (auto, rows)
    assert auto["episodes"] == r.episodes
    chosen_at = summary["rounds"][-1]["at_s"]
    assert chosen_at < 0.25 * auto["wall_s"]
    halves = list(pl.decisions)[-len(pl.decisions) // 2:]           # well after the round: the kept shape's requests
    assert max(k for _, k in halves) <= 2 and max(n for n, _ in halves) <= r.envs // 2
    assert sum(n for n, _ in halves) / len(halves) > 0.6 * r.envs / 2      # mostly full halves, not stragglers


def test_halves_under_a_request_cap_keeps_every_env_served(monkeypatch, planners):
    """Where half the envs exceed the server's cap on a request (16 envs, cap 4), halves sends requests of the cap
    with as many out as it takes to cover every env (4), so no env waits for a slot that never comes; every episode
    runs once."""
    r = ps.with_(ps.REGIMES["gpu-metaworld-16-s10"], max_batch=4, episodes=48)
    out = ps.run(r, "auto", shapes=(HALVES,))
    pl = planners[-1]
    assert pl.shape == HALVES and out["episodes"] == r.episodes
    assert max(n for n, _ in pl.decisions) == 4 and max(k for _, k in pl.decisions) == 4


def test_auto_held_to_greedy_by_config_sends_each_observation_alone(planners):
    """auto_shapes=greedy (SchedulerOptions.shapes): no probe round, and every observation goes as a request of its
    own the moment it waits, as the B=1, P=envs row sends them (session 22, 32 envs on H100s: in the 3 of 6 rounds
    where auto kept greedy, whose requests then packed whoever waited, it ran 3-6% below that row). On the model
    the two send the same requests: every request one observation, the same rate, every episode once."""
    r = ps.REGIMES["gpu-metaworld-32-s19"]
    auto = ps.run(r, "auto", shapes=(GREEDY,))
    fixed = ps.run(r, "pipelines", 1, r.envs)
    pl = planners[-1]
    assert auto["auto_shape"] == {"shape": GREEDY, "probed": False, "rounds": []}
    assert {n for n, _ in pl.decisions} == {1} and auto["mean_batch"] == 1.0
    assert auto["episodes"] == fixed["episodes"] == r.episodes
    assert auto["env_steps_per_s"] == pytest.approx(fixed["env_steps_per_s"], rel=0.02)


def test_an_env_loading_a_scene_is_waited_for_only_when_its_load_ends_within_a_call():
    """joinable_soon: of two envs that could join (neither waiting nor in flight), the one loading a scene counts
    only while its load (predicted from the loads done: 0.3 s) ends within a call (20 ms) from now; a load past
    its predicted end is not waited for; nothing is discounted before a load has been measured."""
    import time

    from wamkit.eval.affinity import TaskAffinity

    class Planner:
        def __init__(self, affinity):
            self.s = type("S", (), {"affinity": affinity})()

        def _joinable(self):
            return 2

        def _median_call(self, last, default):
            return 0.02

    def joinable(started_ago, hint=0.3):
        aff = TaskAffinity({}, hint)
        assert aff.reset_begun(1, 3)                  # env 1 builds task 3's scene
        assert not TaskAffinity({1: 3}).reset_begun(1, 3)   # the scene it has: a soft reset, no load
        aff._loading[1] = time.monotonic() - started_ago
        return scheduler_mod.joinable_soon(Planner(aff))

    assert joinable(0.0) == 1                         # 0.3 s to go: not waited for
    assert joinable(0.29) == 2                        # ~10 ms to go: within a call, waited for
    assert joinable(0.5) == 1                         # past its predicted end: not waited for
    assert joinable(0.0, hint=None) == 2              # no load measured yet: no prediction, every env counts


def sent_while_loading(monkeypatch) -> list[int]:
    """A list that fills with the number of observations waiting at each request sent while an env was loading a
    scene (auto is held to one shape by its options: auto_shapes / SchedulerOptions.shapes)."""
    sent = []
    dispatch = scheduler_mod.RequestPlanner._dispatch

    def logged(self, n):
        if self.s.affinity.loads_under_way():
            sent.append(len(self.pending))
        dispatch(self, n)

    monkeypatch.setattr(scheduler_mod.RequestPlanner, "_dispatch", logged)
    return sent


@pytest.mark.parametrize("shape", [LOCKSTEP, HALVES])
def test_lockstep_and_halves_do_not_hold_a_request_for_an_env_loading_a_scene(monkeypatch, shape):
    """Session 21's 32-env H100 rows: auto's lockstep waited out each mid-run scene load (~0.3 s on MetaWorld) with
    every other env idle, ~1.8 s of a 26 s row. Modelled (16 envs on 8 cores, 6 tasks, loads of 0.3 s: the last
    task switches come at the tail): requests go without the envs whose load is predicted to end more than a call
    from now, they join a later one, every episode runs once, and the row ends sooner than holding for them."""
    r = ps.Regime("loads", 16, 8, 0.0135, 0.0185, 0.00003, net_s=0.0025, jitter=0.4, chunks=12, episodes=96,
                  server_wait_s=0.0, load_s=0.3, task_cost=(0.7, 0.9, 1.1, 1.3, 0.8, 1.2))
    sent_during_loads = sent_while_loading(monkeypatch)
    out = ps.run_tasks(r, 6, 16, "auto", shapes=(shape,))
    assert out["episodes"] == 96 and len({o.episode.key for o in out["done"]}) == 96
    assert out["loads"] > 16                      # task switches after the first loads
    assert sent_during_loads and max(sent_during_loads) >= 8, sent_during_loads
    held = list(sent_during_loads)
    sent_during_loads.clear()
    monkeypatch.setattr(scheduler_mod, "joinable_soon", lambda p: p._joinable())
    before = ps.run_tasks(r, 6, 16, "auto", shapes=(shape,))   # the rule before: every env that could join waited
    assert before["episodes"] == 96
    assert len(sent_during_loads) < len(held)
    # sooner by at least a sixth of one load (modelled: lockstep 0.12 s of its 5.5 s, halves 0.08 s of 4.4 s)
    assert out["wall_s"] < before["wall_s"] - r.load_s / 6, (out["wall_s"], before["wall_s"])


def test_no_probe_where_every_request_is_its_own_model_call(planners):
    r = ps.with_(HETERO, server_wait_s=None)
    ps.run(r, "auto")
    s = planners[-1].shape_summary()
    assert s["probed"] is False and s["shape"] == PLAN and "not merged" in s["why"]


def test_a_fixed_depth_is_not_probed(planners):
    async def go():
        import asyncio

        cores = asyncio.Semaphore(HETERO.cores)
        envs = [ps.SimEnv(i, HETERO, cores) for i in range(4)]
        opts = scheduler_mod.SchedulerOptions(mode="auto", depth=2, cores=HETERO.cores, run_to_max_steps=True,
                                              env_timeout_min_s=600)
        sched = scheduler_mod.Scheduler(envs, ps.SimAccelerator(HETERO), ps.make_plan("sim", [0], 8), opts,
                                        lambda o: None)
        await sched.run()
        return sched.batcher.shape_summary()

    s = ps.run_virtual(go())
    assert s["probed"] is False and s["why"] == "depth fixed"


# ------------------------------------------------------------------ a real evaluation, probe forced
def mw_auto_cfg(out, tasks: str, trials: int, *extra):
    """A real evaluation behind a local `wamkit serve` (websocket): MetaWorld's scripted expert, 2 envs."""
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig

    return load_config(EvalConfig, None, ["env=metaworld", "suite=mt", f"env_args.tasks={tasks}", f"trials={trials}",
                                          "image_size=32", "policy=metaworld-expert", "horizon=4", "max_steps=80",
                                          "progress=false", "num_envs=2", "inference=server", f"out={out}", *extra])


def mw_episodes(out) -> dict:
    """Each episode's outcome view and the digest of the actions it executed."""
    import json

    from wamkit.eval.metrics import outcome_view

    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    digests = {r["key"]: r["actions_digest"] for r in rows}
    return {k: (*v, digests[k]) for k, v in outcome_view(rows).items()}


@pytest.mark.slow
@pytest.mark.metaworld
def test_a_real_auto_eval_probes_switches_and_gets_the_lockstep_rows_episodes(tmp_path, monkeypatch):
    """MetaWorld's scripted expert behind a local `wamkit serve` (websocket), 2 envs, auto with a probe round forced
    early (the run is far too short to pay for one otherwise): the shapes are measured and switched mid-episode,
    and every episode's outcome and executed actions equal the lockstep row's."""
    from wamkit.eval.runner import run_eval

    def cfg(out, *extra):
        return mw_auto_cfg(out, "reach-v3,drawer-open-v3", 3, *extra)

    episodes = mw_episodes

    run_eval(cfg(tmp_path / "lockstep", "mode=pipelines", "request_size=2", "pipelines=1"))
    monkeypatch.setattr(ShapeProbe, "MAX_SHARE", 1e9)
    monkeypatch.setattr(ShapeProbe, "WARM_ANSWERS", 1)
    monkeypatch.setattr(ShapeProbe, "WINDOW_CYCLES", 2.0)
    monkeypatch.setattr(ShapeProbe, "MIN_WINDOW_S", 0.05)
    monkeypatch.setattr(ShapeProbe, "DUEL_LEGS", 2)   # a round (and a duel, if any) that ends well inside the run
    s = run_eval(cfg(tmp_path / "auto", "mode=auto"))
    shape = s["scheduler"]["auto_shape"]
    assert shape["probed"] and set(shape["rounds"][0]["rates_obs_per_s"]) == {PLAN, GREEDY, LOCKSTEP, HALVES}
    assert all(r > 0 for r in shape["rounds"][0]["rates_obs_per_s"].values())
    assert 0 < shape["rounds"][0]["at_s"] < s["throughput"]["wall_s"]     # seconds into the run
    assert s["episodes"] == 6 and episodes(tmp_path / "auto") == episodes(tmp_path / "lockstep")
    assert len({ok for ok, *_ in episodes(tmp_path / "auto").values()}) == 2   # successes and failures both
    off = run_eval(cfg(tmp_path / "off", "mode=auto", "auto_probe=false"))["scheduler"]["auto_shape"]
    assert off == {"shape": PLAN, "probed": False, "why": "probe off", "rounds": []}


@pytest.mark.slow
@pytest.mark.metaworld
def test_a_real_lockstep_sends_while_an_env_loads_a_scene_and_gets_the_fixed_rows_episodes(tmp_path, monkeypatch):
    """MetaWorld's scripted expert behind a local `wamkit serve`, 2 envs on 3 tasks, auto held to the lockstep shape:
    the env whose task runs out first (reach's episodes end sooner than drawer-open's) loads the third task's scene
    while the other env still runs, and a request goes without it (before session 21 it waited for the load);
    every episode's outcome and executed actions equal the fixed lockstep row's."""
    from wamkit.eval.runner import run_eval

    def cfg(out, *extra):
        return mw_auto_cfg(out, "reach-v3,drawer-open-v3,pick-place-v3", 2, *extra)

    episodes = mw_episodes

    run_eval(cfg(tmp_path / "lockstep", "mode=pipelines", "request_size=2", "pipelines=1"))
    sent_during_loads = sent_while_loading(monkeypatch)
    s = run_eval(cfg(tmp_path / "auto", "mode=auto", f"auto_shapes={LOCKSTEP}"))
    assert s["scheduler"]["auto_shape"]["shape"] == LOCKSTEP and s["scheduler"]["scene_loads"] >= 3
    assert sent_during_loads and min(sent_during_loads) == 1, sent_during_loads   # the other env's, alone
    assert s["episodes"] == 6 and episodes(tmp_path / "auto") == episodes(tmp_path / "lockstep")


def test_the_rest_of_the_run_is_bounded_before_any_episode_ends_and_estimated_after():
    """Before an episode has ended, every queued one will outlast the run so far (a lower bound: 40 queued over 4
    envs after 2 s is >= 20 s); after, episodes left x the mean episode / active envs."""
    import time
    from collections import deque
    from types import SimpleNamespace

    inf = SimpleNamespace(max_request_size=64, latencies=[], merges_requests=True)
    sched = SimpleNamespace(inference=inf, opts=scheduler_mod.SchedulerOptions(mode="auto"), episode_walls=deque(),
                            active_envs=4, queue=deque(range(40)), started=time.monotonic() - 2.0)
    planner = scheduler_mod.RequestPlanner(sched)
    assert planner.probe is not None
    assert planner._remaining_s() == pytest.approx(20.0, rel=0.02)
    sched.episode_walls.extend([2.0, 4.0])
    assert planner._remaining_s() == pytest.approx((40 + 4) * 3.0 / 4)
    sched.active_envs = 0
    assert planner._remaining_s() is None


def test_the_planners_estimates_are_computed_only_when_a_round_needs_them():
    """Given as functions, the env cycle and the run's rest are read when a round starts or switches shape, not on
    every answer (each costs medians over the planner's samples, on the event loop that moves the requests); the
    same stream given as functions and as figures gives the same rounds."""
    calls = {"cycle": 0, "remaining": 0}

    def cycle():
        calls["cycle"] += 1
        return 0.05

    def remaining():
        calls["remaining"] += 1
        return 100.0

    stream = {PLAN: steady(100.0), GREEDY: steady(150.0)}
    lazy, eager = ShapeProbe((PLAN, GREEDY)), ShapeProbe((PLAN, GREEDY))
    drive(lazy, stream, until=3.0, cycle=cycle, remaining=remaining)
    drive(eager, stream, until=3.0)
    answers = int(3.0 * 150.0)
    assert lazy.summary() == eager.summary() and len(lazy.rounds) == 1
    # one read to start the round, one per switch and one for the decision's check window; the rest predicted
    # once (the check passed: no second round): far fewer than the ~400 answers
    assert calls == {"cycle": 3, "remaining": 1}, (calls, answers)
    assert lazy.rounds[0].check == pytest.approx(150.0, rel=0.05)


def test_the_planners_decisions_kept_are_the_recent_ones_and_bounded(monkeypatch):
    """RequestPlanner.decisions held every request of a run to its end: now the KEPT_DECISIONS most recent, the
    latest last (what the tests above read of a run)."""
    import asyncio
    import time

    import numpy as np
    from collections import deque
    from types import SimpleNamespace

    async def predict(observations, seeds):
        return np.zeros((len(observations), 2, 2), np.float32)

    monkeypatch.setattr(scheduler_mod, "KEPT_DECISIONS", 4)
    inf = SimpleNamespace(max_request_size=64, latencies=[], merges_requests=False, predict=predict)
    sched = SimpleNamespace(inference=inf, opts=scheduler_mod.SchedulerOptions(mode="auto", depth=64),
                            episode_walls=deque(), active_envs=64, queue=deque(), started=time.monotonic())
    planner = scheduler_mod.RequestPlanner(sched)

    async def main():
        loop, sizes = asyncio.get_running_loop(), []
        for k in range(19):
            n = 1 + k % 3
            futs = [loop.create_future() for _ in range(n)]
            planner.pending += [(None, i, SimpleNamespace(task_id=0), f, 0.0) for i, f in enumerate(futs)]
            planner._dispatch(n)
            sizes.append(n)
            await asyncio.gather(*futs)
            assert len(planner.decisions) < 8 and [m for m, _ in planner.decisions] == sizes[-len(planner.decisions):]
        assert len(planner.decisions) >= 4

    asyncio.run(main())
