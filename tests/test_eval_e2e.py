"""End-to-end evaluation on real simulators: results contract, schedule invariance, faults, resume, CLI errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig
from wamkit.eval.metrics import outcome_view
from processes import descendants, running, start_environ

ROOT = Path(__file__).resolve().parents[1]
MW_TASKS = "env_args.tasks=reach-v3,drawer-open-v3"


def mw_cfg(tmp_path, name, *extra):
    # expert with 4-action chunks: a mix of successes and failures within 60 steps
    return load_config(EvalConfig, None, ["env=metaworld", "suite=mt", MW_TASKS, "trials=2", "image_size=32",
                                          "policy=metaworld-expert", "horizon=4", "max_steps=60", "progress=false",
                                          f"out={tmp_path / name}", *extra])


def results(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "results.jsonl").read_text().splitlines()]


def cli(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "wamkit.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def mw_serial(tmp_path_factory):
    from wamkit.eval.runner import run_eval

    tmp = tmp_path_factory.mktemp("serial")
    run_eval(mw_cfg(tmp, "serial", "mode=serial"))
    return results(tmp / "serial")


@pytest.mark.slow
@pytest.mark.metaworld
def test_metaworld_results_contract(mw_serial, tmp_path):
    recs = mw_serial
    assert len(recs) == 4 and len({r["key"] for r in recs}) == 4
    for r in recs:
        for k in ("suite", "task_id", "task", "trial", "success", "steps", "wall_s"):
            assert k in r
        assert 0 < r["steps"] <= 60
    # failures run to max steps, successes end early: the expert gives a mix here
    assert any(r["success"] for r in recs)


@pytest.mark.slow
@pytest.mark.metaworld
@pytest.mark.parametrize("mode_args", [
    ("mode=auto", "num_envs=3", "env_args.render_backend=osmesa"),
    ("mode=pipelines", "num_envs=2", "request_size=1", "pipelines=2"),
    ("mode=pipelines", "num_envs=2", "request_size=2", "pipelines=1"),
    ("mode=auto", "num_envs=2", "inference=server"),
    ("mode=auto", "num_envs=3", "inference=server", "server.replicas=2"),
    ("mode=auto", "num_envs=2", "inference=server", "server.reserve_cpus=1", "env_nice=5"),
    ("mode=auto", "num_envs=2", "env_args.renderer=shared", "env_args.render_processes=2"),
    ("mode=pipelines", "num_envs=2", "request_size=1", "pipelines=2", "inprocess_batching=true"),
    ("mode=auto", "num_envs=3", "inference=server", "auto_shapes=greedy"),
], ids=["auto3", "B1P2", "B2P1", "auto-server", "auto-2servers", "auto-server-pinned", "auto-shared-renderer",
        "B1P2-inprocess-batching", "auto-server-greedy"])
def test_metaworld_schedule_invariance(mw_serial, tmp_path, mode_args):
    from wamkit.eval.runner import run_eval

    s = run_eval(mw_cfg(tmp_path, "x", *mode_args))
    assert outcome_view(results(tmp_path / "x")) == outcome_view(mw_serial)
    assert s["episodes"] == 4
    # what each env worker rendered with is in the summary (one count per worker; the serial run rendered with
    # this machine's default, EGL on Mesa, the auto3 row with OSMesa: same outcomes)
    n_envs = int(next(a for a in mode_args if a.startswith("num_envs=")).split("=")[1])
    render = s["scheduler"]["env_render"]
    assert sum(render.values()) == n_envs, render
    client = s["scheduler"]["client"]   # the evaluating process's loop, measured over the run (eval/loop_health.py)
    assert 0 < client["loop_cpu"] <= client["process_cpu"] + 0.05 and client["loop_lag_ms"]["n"] > 0
    assert len(client["stalls"]) <= 5 and all(x["ms"] >= 50.0 for x in client["stalls"]) and client["gc_max_ms"] >= 0
    assert s["scheduler"]["gc_frozen_objects"] > 10_000   # the heap setup built, frozen for the run (gc_freeze)
    # the env processes' own time per chunk, inside the chunk's span as this process saw it
    assert 0 < s["scheduler"]["sim_worker_ms_mean"] <= s["scheduler"]["sim_ms_mean"]
    # of it the camera rendering and the process's CPU time (where a spinning GPU wait would show)
    assert 0 < s["scheduler"]["render_worker_ms_mean"] < s["scheduler"]["sim_worker_ms_mean"]
    assert 0 < s["scheduler"]["cpu_worker_ms_mean"]
    if "auto_shapes=greedy" in mode_args:   # held to greedy: unprobed, one observation per request
        assert s["scheduler"]["auto_shape"]["shape"] == "greedy" and not s["scheduler"]["auto_shape"]["probed"]
        assert s["scheduler"]["mean_batch"] == 1.0 and s["scheduler"]["requests"] > 0
    if "env_args.render_backend=osmesa" in mode_args:
        assert render == {"osmesa": n_envs}
    if "env_args.renderer=shared" in mode_args:   # every worker's frames from the render processes
        assert all(k.endswith(" shared") for k in render), render
    if "server.reserve_cpus=1" in mode_args:   # the server on a CPU of its own, the envs on the rest
        from wamkit.core.cpu_pinning import split_cpus

        server, envs = split_cpus(1)
        assert s["scheduler"]["cpus"] == {"server": server, "envs": envs}
        assert s["scheduler"]["env_nice"] == 5     # the env workers at niceness 5, the same outcomes
    else:
        assert s["scheduler"]["cpus"] is None
    if "inference=server" in mode_args:   # the servers it launched batch at most every env's observation
        assert s["scheduler"]["server_max_batch_size"] == n_envs
        # the servers' batches by size: every observation answered was in exactly one of them
        batches = {int(k): v for k, v in s["scheduler"]["server_batches"].items()}
        assert batches and max(batches) <= n_envs
        answered = round(s["scheduler"]["mean_batch"] * s["scheduler"]["requests"])
        assert sum(k * v for k, v in batches.items()) == answered, batches
    if "server.replicas=2" in mode_args:   # both servers answered requests (least-loaded dispatch)
        served = s["scheduler"]["server_requests"]
        assert len(served) == 2 and min(served) > 0, served


@pytest.mark.slow
@pytest.mark.metaworld
def test_env_worker_killed_mid_run_every_episode_once(mw_serial, tmp_path):
    """Kill an env worker while it is busy: its episode is re-run from its init state, nothing lost or doubled."""
    import asyncio

    from wamkit.envs.worker import EnvWorker
    from wamkit.eval.inference import InProcessInference
    from wamkit.eval.plan import make_plan
    from wamkit.eval.runner import env_kwargs
    from wamkit.eval.scheduler import Scheduler, SchedulerOptions
    from wamkit.policies import make_policy

    cfg = mw_cfg(tmp_path, "kill")
    workers = [EnvWorker("metaworld", env_kwargs(cfg), index=i) for i in range(2)]
    for w in workers:
        w.start()
    done: list = []
    killed = []

    def on_done(o):
        done.append(o)
        if not killed:   # after the first episode, kill the other (busy) worker
            other = workers[1 - o.env_index]
            other.kill()
            killed.append(other.index)

    try:
        plan = make_plan("mt", [0, 1], 2)
        pol = make_policy("metaworld-expert", horizon=4)
        sched = Scheduler(workers, InProcessInference(pol), plan, SchedulerOptions(mode="auto"), on_done)
        asyncio.run(sched.run())
    finally:
        for w in workers:
            w.close()
    assert killed and sched.restarts >= 1
    keys = [o.episode.key for o in done]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 4
    assert {o.episode.key: (o.success, o.steps) for o in done} == outcome_view(mw_serial)
    assert any(o.attempts > 1 for o in done)


@pytest.mark.slow
@pytest.mark.metaworld
def test_server_killed_mid_run_is_restarted(mw_serial, tmp_path):
    """SIGKILL the action server during the evaluation: the client restarts it and retries; same results."""
    import asyncio

    from wamkit.envs.worker import EnvWorker
    from wamkit.eval.inference import ServerInference
    from wamkit.eval.plan import make_plan
    from wamkit.eval.runner import env_kwargs
    from wamkit.eval.scheduler import Scheduler, SchedulerOptions

    cfg = mw_cfg(tmp_path, "srv")
    workers = [EnvWorker("metaworld", env_kwargs(cfg), index=i) for i in range(2)]
    for w in workers:
        w.start()
    done: list = []
    inf = ServerInference(policy="metaworld-expert", policy_args={"horizon": 4, "action_dim": 4},
                          options=cfg.server)

    def on_done(o):
        done.append(o)
        if len(done) == 1:
            os.killpg(inf.worker.pid, signal.SIGKILL)

    async def main():
        await inf.start()
        try:
            await Scheduler(workers, inf, make_plan("mt", [0, 1], 2), SchedulerOptions(mode="auto"), on_done).run()
        finally:
            await inf.close()

    try:
        asyncio.run(main())
    finally:
        for w in workers:
            w.close()
    assert inf.restarts >= 1
    assert {o.episode.key: (o.success, o.steps) for o in done} == outcome_view(mw_serial)
    with pytest.raises(ProcessLookupError):
        os.kill(inf.worker.pid, 0)


@pytest.mark.slow
@pytest.mark.metaworld
def test_resume_after_the_eval_process_is_killed(mw_serial, tmp_path):
    """SIGKILL of the evaluating process alone (no atexit, its children not signalled): the action server, the env
    workers and the render process leave by themselves, and resume=true runs only the missing episodes."""
    out = tmp_path / "resume"
    args = ["eval", "env=metaworld", "suite=mt", MW_TASKS, "trials=2", "image_size=32", "policy=metaworld-expert",
            "horizon=4", "max_steps=60", "progress=false", "inference=server", "env_args.renderer=shared",
            f"out={out}"]
    proc = subprocess.Popen([sys.executable, "-m", "wamkit.cli.main", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            p = out / "results.jsonl"
            if p.exists() and len(p.read_text().splitlines()) >= 2:
                break
            if proc.poll() is not None:
                pytest.fail("eval finished before it could be killed")
            time.sleep(0.05)
        kids = descendants(proc.pid)
        assert len(kids) >= 4   # the server, 2+ env workers, the render process (and multiprocessing's tracker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.time() + 15
        while any(map(running, kids)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(running, kids)), f"left behind: {[k for k in kids if running(k)]}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # whatever is left of its session
        except ProcessLookupError:
            pass
    before = results(out)
    assert 2 <= len(before) < 4
    # without resume=true the directory is protected
    r = cli(*args)
    assert r.returncode == 2 and "resume=true" in r.stderr
    r = cli(*args, "resume=true")
    assert r.returncode == 0, r.stderr
    after = results(out)
    assert len(after) == 4 and len({x["key"] for x in after}) == 4
    assert outcome_view(after) == outcome_view(mw_serial)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 4 and summary["throughput"]["episodes_this_run"] == 4 - len(before)
    assert summary["successes"] == sum(int(x["success"]) for x in mw_serial)


def test_cli_errors_exit_2_and_write_nothing(tmp_path):
    out = tmp_path / "nothing"
    for args, needle in ((["env=mujoco"], "unknown env 'mujoco'"), (["policy=gpt"], "unknown policy 'gpt'"),
                         (["suit=x"], "unknown config key 'suit'"), (["mode=fast"], "mode")):
        r = cli("eval", *args, f"out={out}", timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "valid" in r.stderr or needle == "mode"
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()
    r = cli("nope", timeout=60)
    assert r.returncode == 2 and "unknown verb" in r.stderr


@pytest.mark.slow
@pytest.mark.libero
def test_libero_eval_end_to_end(tmp_path):
    out = tmp_path / "lib"
    r = cli("eval", "env=libero", "suite=libero_object", "tasks=0", "trials=1", "policy=zero", "max_steps=16",
            "save_videos=1", "image_size=128", f"out={out}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = results(out)
    assert len(recs) == 1
    rec = recs[0]
    assert rec["suite"] == "libero_object" and rec["task_id"] == 0 and rec["trial"] == 0
    assert rec["success"] is False and rec["steps"] == 16
    s = json.loads((out / "summary.json").read_text())
    assert s["episodes"] == 1 and s["per_task"]["0"]["episodes"] == 1
    assert s["versions"]["mujoco"] and s["versions"]["robosuite"] == "1.4.0"
    assert s["config"]["suite"] == "libero_object"
    # LIBERO imports mujoco only when it builds its first scene, after the worker reported in: still counted
    assert sum(s["scheduler"]["env_render"].values()) == s["scheduler"]["num_envs"]
    assert (out / rec["video"]).stat().st_size > 0
    assert "success rate" in r.stdout and (out / "report.md").exists() and (out / "timeline.png").exists()


@pytest.mark.slow
@pytest.mark.libero
def test_libero_schedule_invariance(tmp_path):
    from wamkit.eval.runner import run_eval

    base = ["env=libero", "suite=libero_object", "tasks=0", "trials=2", "policy=random", "policy_args.scale=0.5",
            "max_steps=24", "image_size=64", "progress=false"]
    views = []
    for i, extra in enumerate((["mode=serial"], ["mode=auto", "num_envs=2"],
                               ["mode=pipelines", "num_envs=2", "request_size=1", "pipelines=2"])):
        run_eval(load_config(EvalConfig, None, base + extra + [f"out={tmp_path / str(i)}"]))
        views.append(outcome_view(results(tmp_path / str(i))))
    assert views[0] == views[1] == views[2]
    assert len(views[0]) == 2


@pytest.mark.slow
@pytest.mark.metaworld
def test_server_start_up_is_setup_not_evaluation_time(mw_serial, tmp_path):
    """A server that takes 8 s more to become healthy (a warm-up) changes setup_s, not the evaluation's wall time
    or throughput; the results are the same episodes. (8 s: more than the envs' start-up and teardown, so a clock
    that counted the start-up would fail the wall-time check.)"""
    from wamkit.eval.runner import run_eval
    from wamkit.serve.workers import WamkitServerWorker

    class SlowStart(WamkitServerWorker):
        def wait_healthy(self, timeout=None, poll_s=0.2):
            time.sleep(8.0)
            return super().wait_healthy(timeout, poll_s)

    t0 = time.perf_counter()
    s = run_eval(mw_cfg(tmp_path, "slow", "mode=auto", "num_envs=2", "inference=server"),
                 server_worker_factory=SlowStart)
    total = time.perf_counter() - t0
    assert s["scheduler"]["setup_s"] >= 8.0
    assert s["throughput"]["wall_s"] <= total - s["scheduler"]["setup_s"]
    assert outcome_view(results(tmp_path / "slow")) == outcome_view(mw_serial)


@pytest.mark.slow
@pytest.mark.metaworld
def test_bench_eval_shares_one_server_across_rows(mw_serial, tmp_path, monkeypatch):
    """bench eval with inference=server starts its server once for every row and the inference bound (not once per
    row), and the rows' per-episode results do not change. A row with its own setting (`auto @
    server.reserve_cpus=1`) pins the shared server and the kept envs for its run only."""
    from wamkit.core.cpu_pinning import split_cpus
    from wamkit.eval.bench import bench_eval
    from wamkit.serve.workers import WamkitServerWorker

    starts, pins, omp, caps = [], [], [], []
    orig, orig_pin = WamkitServerWorker.start, WamkitServerWorker.set_cpus

    def counting_start(self):
        starts.append(self.port)
        caps.append(self.max_batch_size)
        out = orig(self)
        env = start_environ(self.pid)
        omp.append(env.get(b"OMP_WAIT_POLICY"))
        return out

    def recording_pin(self, cpus):
        pins.append(cpus)
        return orig_pin(self, cpus)

    monkeypatch.setattr(WamkitServerWorker, "start", counting_start)
    monkeypatch.setattr(WamkitServerWorker, "set_cpus", recording_pin)
    cfg = mw_cfg(tmp_path, "bench", "inference=server", "num_envs=2", "mode=auto")
    pinned_row = "auto @ server.reserve_cpus=1 env_nice=3"
    shared_row = "auto @ env_args.renderer=shared"   # envs of its own (another env configuration), warmed too
    rep = bench_eval(cfg, tmp_path / "bench", rows=["serial", "auto", pinned_row, shared_row], horizon=4)
    assert len(starts) == 1 and rep["plan"]["shared_servers"] == 1
    log = (tmp_path / "bench" / "server-0.log").read_text()   # its output: in the bench's OUT, not a tempfile
    assert log.count("=== start") == 1 and "wamkit serve: policy=metaworld-expert" in log
    assert caps == [2]   # its batches capped at every env's observation at once (server.max_batch_size 64)
    assert omp == [b"PASSIVE"]   # a row pins it: started so that its OpenMP threads never spin (core/cpu_pinning.py)
    assert [r["row"] for r in rep["rows"]] == ["serial", "auto", pinned_row, shared_row]
    assert rep["bound"]["inference_obs_per_s"] > 0
    assert all(r["request_retries"] == 0 for r in rep["rows"])   # every request answered at its first attempt
    # every row gives each task its pace: every episode recorded its chunks and their seconds
    recs = results(tmp_path / "bench" / "auto")
    assert recs and all(r["chunks"] * 4 >= r["env_steps"] > 0 and r["sim_s"] > 0 for r in recs)
    assert all(set(r["task_chunk_ms"]) == {str(x["task_id"]) for x in recs}
               and min(r["task_chunk_ms"].values()) > 0 for r in rep["rows"])
    server_cpus, env_cpus = split_cpus(1)
    assert pins[:3] == [None, None, server_cpus] and all(p is None for p in pins[3:])   # that row only
    pinned = json.loads((tmp_path / "bench" / "auto__server-reserve_cpus1__env_nice3" / "summary.json").read_text())
    assert pinned["scheduler"]["cpus"] == {"server": server_cpus, "envs": env_cpus}
    assert pinned["scheduler"]["env_nice"] == 3 and json.loads(
        (tmp_path / "bench" / "auto" / "summary.json").read_text())["scheduler"]["env_nice"] == 0
    # the rows run to max steps (the reference's semantics): same successes as the serial run, same outcomes
    # in every row, with the shared server or with the row's own
    shared = outcome_view(results(tmp_path / "bench" / "serial"))
    assert outcome_view(results(tmp_path / "bench" / "auto")) == shared
    assert outcome_view(results(tmp_path / "bench" / "auto__server-reserve_cpus1__env_nice3")) == shared
    shared_renderer = json.loads((tmp_path / "bench" / "auto__env_args-renderershared" / "summary.json").read_text())
    assert all(k.endswith(" shared") for k in shared_renderer["scheduler"]["env_render"])
    assert outcome_view(results(tmp_path / "bench" / "auto__env_args-renderershared")) == shared
    assert {k: s for k, (s, _) in shared.items()} == {k: s for k, (s, _) in outcome_view(mw_serial).items()}
    starts.clear()
    bench_eval(cfg, tmp_path / "bench2", rows=["auto"], horizon=4, share_server=False)
    assert len(starts) == 2          # the row's own server, then the inference bound's
    assert "wamkit serve: policy=metaworld-expert" in (tmp_path / "bench2" / "auto" / "server-0.log").read_text()
    assert outcome_view(results(tmp_path / "bench2" / "auto")) == shared


@pytest.mark.slow
@pytest.mark.metaworld
def test_bench_eval_rounds_and_contended_bound(mw_serial, tmp_path):
    """rounds=2 runs each row twice (interleaved) and reports the median with both rounds' rates; the contended
    bound runs simulation while the server is loaded, and is reported beside the separate one; outcomes unchanged.
    With server.reserve_cpus for the whole bench, the bounds' in-process simulation runs keep the rows' CPU split."""
    from wamkit.core.cpu_pinning import split_cpus
    from wamkit.eval.bench import bench_eval, markdown

    cfg = mw_cfg(tmp_path, "bench", "inference=server", "num_envs=2", "mode=auto", "server.reserve_cpus=1")
    rep = bench_eval(cfg, tmp_path / "bench", rows=["B=2, P=1", "auto"], horizon=4, rounds=2, bound="contended",
                     deadline_s=3600)   # far off: every row runs (eval/deadline.py's cut: tests/test_deadline.py)
    assert rep["rounds"] == 2 and [r["row"] for r in rep["rows"]] == ["B=2, P=1", "auto"]
    assert "stopped" not in rep
    assert rep["order"] == [["B=2, P=1", "auto"], ["auto", "B=2, P=1"]]   # every other round in reverse
    for r in rep["rows"]:
        assert len(r["rounds"]) == 2 and min(r["rounds"]) <= r["env_steps_per_s"] <= max(r["rounds"])
        assert r["of_contended_bound"] > 0 and r["scene_loads"] >= 0
        # this host's CPUs over each round (/proc/stat): the rows were working them
        assert len(r["host_cpu_rounds"]) == 2 and all(0 < h["busy"] <= 1 and 0 <= h["steal"] < 1
                                                      for h in r["host_cpu_rounds"])
    c = rep["bound"]["contended"]
    assert c["sim_env_steps_per_s"] > 0 and c["inference_obs_per_s"] > 0
    server, envs = split_cpus(1)
    for run in ("bound_sim", "bound_sim_contended", "auto/round1"):
        summary = json.loads((tmp_path / "bench" / run / "summary.json").read_text())
        assert summary["scheduler"]["cpus"] == {"server": server, "envs": envs}, run
    assert rep["bound"]["inference_batch"] == c["inference_batch"] == 2   # every env's observation at once
    assert c["bound_env_steps_per_s"] == min(c["sim_env_steps_per_s"], c["inference_obs_per_s"] * 4)
    assert "Contended" in markdown(rep) and "spread over 2 rounds" in markdown(rep)
    lp = rep["bound"]["loop"]           # the env-loop bound: measured chunk and call, 2 envs x horizon 4
    assert lp["chunk_s"] > 0 and lp["call_s"] > 0
    assert lp["bound_env_steps_per_s"] == pytest.approx(2 * 4 / (lp["chunk_s"] + lp["call_s"]))
    assert rep["bound"]["honest_env_steps_per_s"] == min(c["bound_env_steps_per_s"], lp["bound_env_steps_per_s"])
    assert all(r["of_honest_bound"] >= r["of_contended_bound"] for r in rep["rows"])
    assert "Loop bound" in markdown(rep)
    fixed, auto = rep["rows"]           # auto against the one fixed row, over the medians and round by round
    vs = rep["auto_vs_best_fixed"]["auto"]
    assert vs["best_fixed"] == "B=2, P=1" and vs["ratio"] == pytest.approx(auto["env_steps_per_s"]
                                                                           / fixed["env_steps_per_s"])
    assert vs["per_round"] == pytest.approx([a / f for a, f in zip(auto["rounds"], fixed["rounds"])])
    assert "of the best fixed row (B=2, P=1)" in markdown(rep)
    for row in ("B2_P1", "auto"):       # each round's pace over time: every chunk its timeline holds, once
        for k in (1, 2):
            run = tmp_path / "bench" / row / f"round{k}"
            pr = json.loads((run / "summary.json").read_text())["scheduler"]["progress"]
            spans = json.loads((run / "timeline.json").read_text())["spans"]
            assert sum(pr["chunks"]) == sum(s["kind"] == "sim" for s in spans) > 0
            assert 0 < pr["tail_from_s"] < pr["wall_s"]
    assert [p["chunks"] for p in auto["progress_rounds"]] == [
        json.loads((tmp_path / "bench" / "auto" / f"round{k}" / "summary.json").read_text())["scheduler"]
        ["progress"]["chunks"] for k in (1, 2)]
    serial = {k: s for k, (s, _) in outcome_view(mw_serial).items()}
    for row in ("B2_P1", "auto"):
        for k in (1, 2):
            got = outcome_view(results(tmp_path / "bench" / row / f"round{k}"))
            assert {key: s for key, (s, _) in got.items()} == serial


@pytest.mark.slow
@pytest.mark.metaworld
def test_episode_videos_are_written_off_the_loop_and_journaled_after_them(mw_serial, tmp_path, monkeypatch):
    """Videos of every episode with an encoder slowed to 0.3 s each: the evaluating loop never stalls on it (before
    session 21 each video held every env for its encoding: 121 ms a LIBERO episode in `make demo`); every episode
    is journaled once, with its video on disk, and the outcomes equal the serial run's."""
    import time as time_mod

    from wamkit.eval import video
    from wamkit.eval.runner import run_eval

    real = video.write_mp4

    def slow_write_mp4(*a, **kw):
        time_mod.sleep(0.3)
        return real(*a, **kw)

    monkeypatch.setattr(video, "write_mp4", slow_write_mp4)
    s = run_eval(mw_cfg(tmp_path, "v", "mode=auto", "num_envs=2", "save_videos=4"))
    recs = results(tmp_path / "v")
    assert len(recs) == 4 and len({r["key"] for r in recs}) == 4 and s["episodes"] == 4
    assert all((tmp_path / "v" / r["video"]).stat().st_size > 0 for r in recs)
    assert outcome_view(recs) == outcome_view(mw_serial)
    stalls = s["scheduler"]["client"]["stalls"]
    assert not [x for x in stalls if any("write_mp4" in w for w in x["where"])], stalls   # (old code: 426 ms there)


@pytest.mark.slow
@pytest.mark.metaworld
def test_output_directory_faults_found_by_a_probe(tmp_path):
    """What a probe of the eval's output handling found, each now one line or handled:
    - a resume with nothing left to run (a run killed after its last episode was journaled) crashed drawing an
      empty timeline (KeyError) and overwrote the first run's timeline.json; now it writes the summary and report
      and keeps the timeline, and (a docs probe, session 30) keeps the last measured throughput and scheduler
      figures instead of zeros;
    - a resume that changes server.policy was accepted (two policies' results in one summary);
    - a second evaluation into a directory another one is writing ran too (both journaled there);
    - duplicate task ids ran twice, then crashed ("recorded twice");
    - out= that is a file was a traceback, after every env worker had been built;
    - journal records outside the plan were counted in the summary."""
    from wamkit.core.errors import UserError
    from wamkit.eval.runner import LOCK, run_eval

    out = tmp_path / "x"
    first = json.loads(json.dumps(run_eval(mw_cfg(tmp_path, "x", "tasks=0"))))
    tl = (out / "timeline.json").read_text()
    kept = run_eval(mw_cfg(tmp_path, "x", "tasks=0", "resume=true"))        # nothing to run: the figures stay
    assert kept["throughput"] == first["throughput"] and kept["scheduler"] == first["scheduler"]
    assert kept["throughput"]["env_steps_per_s"] > 0 and kept["episodes"] == 2
    (out / "summary.json").unlink()
    (out / "report.md").unlink()
    again = run_eval(mw_cfg(tmp_path, "x", "tasks=0", "resume=true"))       # nothing left to run
    assert again["episodes"] == first["episodes"] == 2 and (out / "report.md").exists()
    assert (out / "timeline.json").read_text() == tl and not (out / LOCK).exists()
    with pytest.raises(UserError, match="different server.policy"):
        run_eval(mw_cfg(tmp_path, "x", "tasks=0", "resume=true", "inference=server", "server.policy=zero"))
    (out / LOCK).write_text(str(os.getppid()))                           # a live process holds it
    with pytest.raises(UserError, match=f"being written by another evaluation \\(pid {os.getppid()}\\)"):
        run_eval(mw_cfg(tmp_path, "x", "tasks=0", "resume=true"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK).write_text(str(dead.pid))                               # its holder was killed: taken over
    run_eval(mw_cfg(tmp_path, "x", "tasks=0", "resume=true"))
    with pytest.raises(UserError, match="task 0 is listed twice"):
        run_eval(mw_cfg(tmp_path, "dup", "tasks=0,0"))
    (tmp_path / "afile").write_text("x")
    p = cli("eval", "env=metaworld", MW_TASKS, "trials=1", "policy=zero", "progress=false",
            f"out={tmp_path / 'afile'}")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "not a writable directory" in p.stderr
    # a policy whose chunks do not fit the env (5 action dims for MetaWorld's 4): one line, exit 1
    p = cli("eval", "env=metaworld", MW_TASKS, "trials=1", "policy=fixed-cost", "policy_args.action_dim=5",
            "policy_args.base_ms=0", "max_steps=8", "progress=false", f"out={tmp_path / 'shape'}")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "returned actions of shape [1, 16, 5] for 1 observation(s); the envs need (1, H, 4)" in p.stderr
    # a record of a trial outside the plan (journals merged by hand): kept in the file but not summarized
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(dict(results(out)[0], key="mt/0/7", trial=7)) + "\n")
    s = run_eval(mw_cfg(tmp_path, "x", "tasks=0", "resume=true"))
    assert s["episodes"] == 2 and len(results(out)) == 3
