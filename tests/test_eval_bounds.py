"""The env-loop bound of bench eval (eval/bench.py): an env cannot simulate while it waits for its actions, so no
schedule beats num_envs x horizon / (fastest chunk + fastest call); the honest bound is the tightest measured one."""

from __future__ import annotations

import pytest

from wamkit.eval.bench import add_ratios, honest_bound, loop_bound


def test_loop_bound_from_the_simulation_alone_rate():
    # 16 envs on 16 cores simulating 6400 env steps/s together: 400 steps/s each, a 16-step chunk takes 40 ms;
    # with a 35 ms call every env cycles in 75 ms
    lp = loop_bound(16, 16, 6400.0, 16, 0.035)
    assert lp["chunk_s"] == pytest.approx(0.040)
    assert lp["bound_env_steps_per_s"] == pytest.approx(16 * 16 / 0.075)
    # twice the envs on the same cores: the simulation-alone run shared each core between two envs, so an env's
    # chunk with a core to itself is still 40 ms, and the loop bound doubles
    lp32 = loop_bound(32, 16, 6400.0, 16, 0.035)
    assert lp32["chunk_s"] == pytest.approx(0.040)
    assert lp32["bound_env_steps_per_s"] == pytest.approx(2 * lp["bound_env_steps_per_s"])


def test_a_rows_faster_chunk_makes_the_loop_bound():
    """The simulation-alone run has every env simulating at once; in a row most envs wait for actions and the rest
    simulate faster (H100, session 15: 14 ms chunks in the rows, 25 ms from the simulation-alone rate). A bound on
    25 ms would sit below what those rows could reach: the fastest chunk seen is the one the bound takes."""
    est = loop_bound(16, 16, 6400.0, 16, 0.035)                        # 40 ms from the simulation-alone rate
    lp = loop_bound(16, 16, 6400.0, 16, 0.035, row_chunks_s=[0.030, 0.0, 0.025])
    assert lp["chunk_from"] == "rows" and lp["chunk_s"] == pytest.approx(0.025)
    assert lp["sim_alone_chunk_s"] == pytest.approx(0.040)
    assert lp["bound_env_steps_per_s"] == pytest.approx(16 * 16 / 0.060)
    assert lp["bound_env_steps_per_s"] > est["bound_env_steps_per_s"]
    slower = loop_bound(16, 16, 6400.0, 16, 0.035, row_chunks_s=[0.050])   # rows slower: the estimate stands
    assert slower["chunk_from"] == "simulation alone" and slower["chunk_s"] == pytest.approx(0.040)
    # the honest bound then falls to the contended stage bound where that is lower
    assert honest_bound(9000.0, {"bound_env_steps_per_s": 4000.0}, lp) == 4000.0
    assert honest_bound(9000.0, {"bound_env_steps_per_s": 4000.0}, est) == pytest.approx(16 * 16 / 0.075)
    # the report says where the chunk came from
    from wamkit.eval.bench import markdown

    rows = [{"row": "B=8, P=2", "env_steps_per_s": 3000.0, "episodes_per_hour": 1.0, "episodes": 4,
             "inference_obs_per_s": 190.0, "mean_batch": 8.0}]
    add_ratios(rows, 9000.0, {"bound_env_steps_per_s": 4000.0}, lp)
    report = {"rows": rows, "rounds": 1, "plan": {"num_envs": 16},
              "bound": {"bound_env_steps_per_s": 9000.0, "sim_env_steps_per_s": 9000.0, "inference_obs_per_s": 900.0,
                        "inference_batch": 16, "horizon": 16, "contended": {"bound_env_steps_per_s": 4000.0,
                                                                             "sim_env_steps_per_s": 5000.0,
                                                                             "inference_obs_per_s": 500.0,
                                                                             "inference_batch": 16},
                        "loop": lp, "honest_env_steps_per_s": 4000.0}}
    md = markdown(report)
    assert "chunk 25.0 ms, a row's mean chunk: the simulation-alone run's was 40.0 + fastest call 35.0 ms" in md
    assert "B=8, P=2 0.75" in md


def test_honest_bound_is_the_tightest_and_rows_are_measured_against_it():
    loop = loop_bound(16, 16, 6400.0, 16, 0.035)          # 3413.3
    contended = {"bound_env_steps_per_s": 4436.0}
    assert honest_bound(6588.0, contended, loop) == pytest.approx(loop["bound_env_steps_per_s"])
    assert honest_bound(6588.0, None, None) == 6588.0
    assert honest_bound(3000.0, None, loop) == 3000.0
    rows = [{"row": "B=4, P=4", "env_steps_per_s": 3400.0, "episodes_per_hour": 1.0},
            {"row": "auto", "env_steps_per_s": 3100.0, "episodes_per_hour": 1.0}]
    add_ratios(rows, 6588.0, contended, loop)
    assert rows[0]["of_honest_bound"] == pytest.approx(3400.0 / loop["bound_env_steps_per_s"])
    assert rows[1]["of_contended_bound"] == pytest.approx(3100.0 / 4436.0)
    assert rows[1]["of_loop_bound"] == rows[1]["of_honest_bound"]


def test_the_inference_bound_is_measured_at_every_envs_observation_at_once():
    """Not at auto's mean request size: sending at once, auto's requests average ~1 observation while the server
    merges them; the bound's batch is num_envs, capped by the request cap."""
    from wamkit.core.config import load_config
    from wamkit.eval.bench import bound_batch
    from wamkit.eval.config import EvalConfig

    cfg = load_config(EvalConfig, None, ["env=metaworld", "inference=server"])
    assert bound_batch(cfg, 16) == 16 and bound_batch(cfg, 1) == 1
    assert bound_batch(cfg, 128) == cfg.server.max_batch_size == 64
    capped = load_config(EvalConfig, None, ["env=metaworld", "max_request_size=8"])
    assert bound_batch(capped, 16) == 8


def test_the_tables_show_rows_against_the_honest_bound_when_measured():
    """The printed and markdown tables' bound column is the honest bound where the run measured it (the separate-
    stage bound overstates a row's ceiling: on the H200 it read 0.40 for a row at 0.70 of the honest one)."""
    from rich.console import Console

    from wamkit.eval.bench import markdown, table

    loop = loop_bound(16, 16, 6400.0, 16, 0.035)          # 3413.3: the tightest
    rows = [{"row": "B=1, P=16", "env_steps_per_s": 3072.0, "episodes_per_hour": 1.0, "episodes": 4,
             "inference_obs_per_s": 192.0, "mean_batch": 1.0}]
    add_ratios(rows, 8000.0, {"bound_env_steps_per_s": 4436.0}, loop)
    report = {"rows": rows, "rounds": 1, "plan": {"num_envs": 16},
              "bound": {"bound_env_steps_per_s": 8000.0, "sim_env_steps_per_s": 8000.0, "inference_obs_per_s": 900.0,
                        "inference_batch": 16, "horizon": 16, "contended": None, "loop": loop,
                        "honest_env_steps_per_s": loop["bound_env_steps_per_s"]}}
    want = f"{3072.0 / loop['bound_env_steps_per_s']:.2f}"           # 0.90, not 3072 / 8000 = 0.38
    md = markdown(report)
    assert "| of honest bound |" in md.splitlines()[0] and f"| {want} |" in md.splitlines()[2]
    con = Console(width=200, record=True)
    con.print(table(report))
    text = con.export_text()
    assert "of honest bound" in text and want in text and "0.38" not in text
    # a run without the loop bound (reports written before it existed) keeps the stage bound
    del rows[0]["of_honest_bound"]
    assert "| of bound |" in markdown(dict(report, bound=dict(report["bound"], loop=None))).splitlines()[0]


def test_the_report_says_what_the_env_workers_rendered_with():
    from wamkit.eval.bench import render_line

    same = [{"row": "B=1, P=16", "env_render": {"osmesa": 16}}, {"row": "auto", "env_render": {"osmesa": 16}}]
    assert render_line(same) == "Env workers rendered with: osmesa x16."
    mixed = [{"row": "B=1, P=16", "env_render": {"egl": 15, "egl device 1": 1}}, {"row": "auto"}]
    assert render_line(mixed) == "Env workers rendered with: B=1, P=16: egl x15, egl device 1 x1; auto: -."
    assert render_line([{"row": "auto"}]) == ""   # reports from before it was recorded, or no MuJoCo


def test_the_report_says_what_auto_measured_and_kept():
    """Each auto row's probe rounds (rates, a duel after a close call, the shape chosen) and the shape kept in every
    round of the bench, in the report and on the console; rows that did not probe say nothing."""
    from wamkit.eval.bench import markdown, probe_lines

    auto = {"row": "auto", "auto_shapes": ["halves", "greedy"], "auto_shape": {"shape": "halves", "probed": True,
            "rounds": [{"at_s": 2.535, "active": 16, "rates_obs_per_s": {"greedy": 312.43, "halves": 308.04},
                        "duel_obs_per_s": {"greedy": 301.2, "halves": 309.9}, "chosen": "halves"}]}}
    fixed = {"row": "B=8, P=2"}
    unprobed = {"row": "auto-plan", "auto_shape": {"shape": "plan", "probed": False, "rounds": []}}
    lines = probe_lines([fixed, auto, unprobed])
    assert lines == ["auto kept halves, greedy (probe rounds of the median run: at 2.5 s with 16 envs: greedy "
                     "312.4, halves 308.0 obs/s; duel greedy 301.2, halves 309.9 -> halves)."]
    assert probe_lines([fixed, unprobed]) == []
    # a decision whose check failed, and the recheck it started
    checked = {"row": "auto", "auto_shape": {"shape": "halves", "probed": True, "rounds": [
        {"at_s": 3.091, "active": 32, "rates_obs_per_s": {"plan": 476.94, "halves": 326.85}, "chosen": "plan",
         "check_obs_per_s": 401.2},
        {"at_s": 4.9, "active": 32, "rates_obs_per_s": {"plan": 401.2, "halves": 480.0}, "chosen": "halves",
         "recheck": True}]}}
    assert probe_lines([checked]) == [
        "auto kept halves (probe rounds of the median run: at 3.1 s with 32 envs: plan 476.9, halves 326.9 obs/s "
        "-> plan, checked at 401.2; recheck at 4.9 s with 32 envs: plan 401.2, halves 480.0 obs/s -> halves)."]
    # the start rule's choice (scheduler.start_shape): said whether or not a round followed
    began = {"shape": "greedy", "chunk_ms": 299.06, "call_ms": 35.2}
    short = {"row": "auto", "auto_shape": {"shape": "greedy", "probed": False, "rounds": [], "began_with": began}}
    assert probe_lines([short]) == ["auto began with greedy (a chunk 299.1 ms, a call 35.2 ms) and ran it unprobed "
                                    "(no probe round paid back in the median run)."]
    long = {"row": "auto", "auto_shape": dict(checked["auto_shape"], began_with=dict(began, shape="plan"))}
    assert probe_lines([long])[0].startswith("auto began with plan (a chunk 299.1 ms, a call 35.2 ms), kept halves "
                                             "(probe rounds of the median run: at 3.1 s")
    row = dict(auto, episodes=4, episodes_per_hour=1.0, env_steps_per_s=1.0, inference_obs_per_s=1.0,
               mean_batch=1.0, ratio_steps=None, ratio_episodes=None)
    report = {"rows": [row], "rounds": 1, "bound": {"bound_env_steps_per_s": None}}
    assert lines[0] in markdown(report)



def test_the_report_puts_auto_against_the_best_fixed_row_round_by_round():
    """#19's measure in the report: each auto row's env steps/s over the best fixed (B, P) row's (A/B rows with
    settings count as fixed rows), from the median rows and round by round (round k's rows against each other, not
    the medians: the best fixed row can differ by round); nothing without fixed rows."""
    from wamkit.eval.bench import auto_lines, auto_vs_best_fixed, markdown

    rows = [{"row": "B=16, P=2", "env_steps_per_s": 100.0, "rounds": [100.0, 90.0, 110.0]},
            {"row": "B=16, P=2 @ env_nice=10", "env_steps_per_s": 95.0, "rounds": [95.0, 96.0, 80.0]},
            {"row": "auto", "env_steps_per_s": 99.0, "rounds": [99.0, 97.0, 88.0]},
            {"row": "single-batch", "env_steps_per_s": 10.0, "rounds": [10.0, 10.0, 10.0]}]
    got = auto_vs_best_fixed(rows + [{"row": "auto+", "env_steps_per_s": 150.0}])   # auto+: another workload
    assert set(got) == {"auto"} and got["auto"]["best_fixed"] == "B=16, P=2"
    assert got["auto"]["ratio"] == pytest.approx(0.99)
    assert got["auto"]["per_round"] == pytest.approx([0.99, 97.0 / 96.0, 0.8])
    report = {"rows": [dict(x, episodes=1, episodes_per_hour=1.0, inference_obs_per_s=1.0, mean_batch=1.0,
                            ratio_steps=None, ratio_episodes=None) for x in rows],
              "rounds": 3, "bound": {"bound_env_steps_per_s": None}, "auto_vs_best_fixed": got}
    assert auto_lines(report) == ["auto: 0.990 of the best fixed row (B=16, P=2); round by round 0.990, 1.010, "
                                  "0.800."]
    assert auto_lines(report)[0] in markdown(report)
    del report["auto_vs_best_fixed"]    # a report written before it was recorded: computed from its rows
    assert auto_lines(report)[0] in markdown(report)
    one = [{"row": "B=1, P=16", "env_steps_per_s": 200.0}, {"row": "auto", "env_steps_per_s": 190.0}]
    assert auto_vs_best_fixed(one) == {"auto": {"best_fixed": "B=1, P=16", "ratio": 0.95}}
    assert auto_vs_best_fixed([{"row": "auto", "env_steps_per_s": 1.0}]) == {}
    assert auto_lines({"rows": []}) == []


def test_the_report_says_where_an_envs_cycle_goes():
    """timeline.env_cycle: per env lane, sim spans' mean and the mean gap from a sim's end to that lane's next span
    only when it is a sim (a reset after a sim ends the episode: no request between); cycle_lines puts it beside
    the request and the server's compute."""
    from wamkit.eval.bench import cycle_lines, markdown
    from wamkit.eval.timeline import Timeline

    tl = Timeline(0.0)
    # env 0: sim 10 ms, wait 30, sim 20, then a reset (no wait counted); env 1: sim 30, wait 50, sim 10
    for lane, kind, t0, t1 in [("env/0", "sim", 0.00, 0.01), ("env/0", "sim", 0.04, 0.06),
                               ("env/0", "reset", 0.10, 0.20), ("env/1", "sim", 0.00, 0.03),
                               ("env/1", "sim", 0.08, 0.09), ("request", "request", 0.01, 0.03)]:
        tl.add(lane, kind, t0, t1)
    c = tl.utilization()
    assert c["sim_ms_mean"] == pytest.approx(17.5) and c["env_wait_ms_mean"] == pytest.approx(40.0)   # (30+50)/2
    row = {"row": "B=8, P=2", "sim_ms_mean": 18.7, "env_wait_ms_mean": 40.4, "request_ms_mean": 29.1,
           "compute_ms_mean": 23.6}
    lines = cycle_lines([row, {"row": "old report"}])
    assert lines == ["B=8, P=2: an env's cycle 59.1 ms = chunk 18.7 + waiting 40.4 for the next one (request 29.1, "
                     "server 23.6; outside the request 11.3: cohort, batch, dispatch)."]
    merged = dict(row, server_batches={"8": 3, "16": 1})   # the server's batches by size: 40 observations in 4
    assert cycle_lines([merged]) == [lines[0].replace("server 23.6;", "server 23.6 a batch of 10.0 observations;")]
    worker = dict(row, sim_worker_ms_mean=16.25)   # the env processes' own time per chunk (ChunkResult.worker_s)
    assert cycle_lines([worker]) == [lines[0].replace("chunk 18.7 +", "chunk 18.7 (in the env's process 16.2) +")]
    split = dict(worker, cpu_worker_ms_mean=15.81, render_worker_ms_mean=4.14)   # its CPU time and rendering
    assert cycle_lines([split]) == [lines[0].replace("chunk 18.7 +", "chunk 18.7 (in the env's process 16.2: CPU "
                                                                     "15.8, rendering 4.1) +")]
    paced = dict(row, task_chunk_ms={"0": 9.54, "1": 20.31, "2": 13.0})   # the tasks' paces (per_task chunk_ms)
    assert cycle_lines([paced]) == [lines[0][:-1] + "; the tasks' chunks 9.5-20.3 ms."]
    assert cycle_lines([dict(row, task_chunk_ms={"0": 9.54})]) == lines[:1]   # one task: no range
    hosted = dict(row, host_cpu={"busy": 0.7234, "steal": 0.0412})   # bench eval's /proc/stat shares of the row
    assert cycle_lines([hosted]) == [lines[0][:-1] + "; host CPUs 72% busy, 4.1% stolen."]
    quota = dict(row, host_cpu={"busy": 0.7234, "steal": 0.0412, "throttled": {"periods": 7, "seconds": 0.412}})
    assert cycle_lines([quota]) == [lines[0][:-1] + "; host CPUs 72% busy, 4.1% stolen, throttled 0.41 s in 7 "
                                                    "periods."]
    quota["host_cpu"]["throttled"] = {"periods": 0, "seconds": 0.0}      # a quota that never stopped it: not said
    assert cycle_lines([quota]) == cycle_lines([hosted])
    client = dict(row, client={"loop_cpu": 0.431, "process_cpu": 0.9,
                               "loop_lag_ms": {"p50": 0.84, "p99": 6.27, "max": 9.0, "n": 10}})
    assert cycle_lines([client]) == [lines[0][:-1] + "; the client's loop 43% of a core, its timers late 0.8 ms "
                                                     "(p99 6.3)."]
    client["client"]["stalls"] = [{"ms": 318.2, "at_s": 4.07, "where": ["journal.py:101 append", "runner.py:281 x"]},
                                  {"ms": 120.0, "at_s": 9.0, "where": []}]
    assert cycle_lines([client]) == [lines[0][:-1] + "; the client's loop 43% of a core, its timers late 0.8 ms "
                                                     "(p99 6.3), its longest stall 318 ms at 4.1 s in journal.py:101 "
                                                     "append."]
    client["client"]["stalls"][0]["where"] = ["selectors.py:468 select", "base_events.py:1884 _run_once"]
    assert cycle_lines([client])[0].endswith("its longest stall 318 ms at 4.1 s in select past its timer (the host "
                                             "did not run the process).")
    row.update(episodes=4, episodes_per_hour=1.0, env_steps_per_s=1.0, inference_obs_per_s=1.0, mean_batch=1.0,
               ratio_steps=None, ratio_episodes=None)
    assert lines[0] in markdown({"rows": [row], "rounds": 1, "bound": {"bound_env_steps_per_s": None}})


def test_rounds_alternate_their_order():
    """bench eval's rounds run the rows as listed, then reversed, and so on: a drift during a round (later rows
    faster or slower) touches every row alike over an even number of rounds."""
    from wamkit.eval.bench import round_order

    rows = [("A", 1), ("B", 2), ("C", 3)]
    assert [[n for n, _ in round_order(rows, k)] for k in range(4)] == [["A", "B", "C"], ["C", "B", "A"]] * 2
    assert rows == [("A", 1), ("B", 2), ("C", 3)]   # the caller's list is left as it was


def test_a_row_over_rounds_keeps_every_rounds_chunk_figures():
    """Rows were compared through their median runs only, which are different rounds (session 31: greedy's round 3
    against auto's round 2); with an even number of rounds the details are the lower middle run's. Each round's
    chunk figures are kept beside, so rows compare round by round."""
    from wamkit.eval.bench import _median_row

    runs = [{"row": "auto", "env_steps_per_s": r, "episodes_per_hour": 10 * r, "sim_worker_ms_mean": w,
             "cpu_worker_ms_mean": c, "render_worker_ms_mean": None, "task_chunk_ms": {"0": w}}
            for r, w, c in ((500.0, 410.0, 400.0), (480.0, 430.0, 425.0), (520.0, 400.0, 390.0), (490.0, 420, 410))]
    med = _median_row(runs)
    assert med["env_steps_per_s"] == 495.0 and med["sim_worker_ms_mean"] == 420    # the lower middle run's details
    assert med["sim_worker_ms_rounds"] == [410.0, 430.0, 400.0, 420]
    assert med["cpu_worker_ms_rounds"] == [400.0, 425.0, 390.0, 410]
    assert med["task_chunk_ms_rounds"] == [{"0": 410.0}, {"0": 430.0}, {"0": 400.0}, {"0": 420}]
    assert "render_worker_ms_rounds" not in med                                       # no round has it
