"""server.reserve_cpus: the servers an evaluation starts on CPUs of their own, its env workers on the rest
(core/cpu_pinning.py): the split, real processes pinned (every thread, and again after a restart), and the errors."""

from __future__ import annotations

import os

import pytest

from wamkit.core.config import load_config
from wamkit.core.cpu_pinning import pin_process, split_cpus, usable_cpus
from wamkit.core.errors import UserError
from wamkit.eval.config import EvalConfig
from wamkit.eval.runner import eval_cpu_split

pytestmark = pytest.mark.skipif(len(usable_cpus()) < 2, reason="needs at least 2 CPUs to split")


def thread_cpus(pid: int) -> set[tuple[int, ...]]:
    """The CPU sets of every thread of process `pid`."""
    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}


def test_the_split_gives_the_servers_the_last_cpus_and_the_envs_the_rest():
    assert split_cpus(0) is None
    assert split_cpus(2, [5, 1, 3, 2]) == ([3, 5], [1, 2])
    server, envs = split_cpus(1)
    assert server + envs == sorted(usable_cpus())[-1:] + sorted(usable_cpus())[:-1] and len(server) == 1
    for bad in (4, -1):
        with pytest.raises(UserError, match="server.reserve_cpus"):
            split_cpus(bad, [0, 1, 2, 3])


def test_reserve_cpus_says_it_needs_linux_where_there_is_no_affinity_call(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(UserError, match="server.reserve_cpus=1 pins processes to CPUs, which needs Linux"):
        split_cpus(1)
    assert split_cpus(0) is None


def test_reserve_cpus_needs_servers_started_here():
    ok = load_config(EvalConfig, None, ["inference=server", "server.reserve_cpus=1"])
    assert eval_cpu_split(ok) == split_cpus(1)
    assert eval_cpu_split(load_config(EvalConfig, None, ["inference=server"])) is None
    for extra, why in ((["inference=inprocess"], "inference=inprocess starts none"),
                       (["inference=server", "server.url=http://127.0.0.1:9"], "with server.url"),
                       (["inference=server", "runtime=ray"], "runtime=ray places them")):
        with pytest.raises(UserError, match=f"server.reserve_cpus=1 pins the action servers .*{why}"):
            eval_cpu_split(load_config(EvalConfig, None, [*extra, "server.reserve_cpus=1"]))
    # servers the caller keeps (bench eval's shared ones) count, also beside an in-process run (its sim-alone bound)
    inproc = load_config(EvalConfig, None, ["inference=inprocess", "server.reserve_cpus=1"])
    assert eval_cpu_split(inproc, kept_servers=True) == split_cpus(1)


def threaded_child():
    """A child process with 3 threads running: it prints 'up', then on a line from stdin starts a 4th thread and
    prints 'more', then on another line lets them all end."""
    import subprocess
    import sys

    code = ("import threading, sys\n"
            "ev = threading.Event()\n"
            "[threading.Thread(target=ev.wait).start() for _ in range(3)]\n"
            "print('up', flush=True); sys.stdin.readline()\n"
            "threading.Thread(target=ev.wait).start()\n"
            "print('more', flush=True); sys.stdin.readline(); ev.set()\n")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def thread_nices(pid: int) -> set[int]:
    """The niceness of every thread of process `pid` (field 19 of /proc/pid/task/tid/stat)."""
    out = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{t}/stat").read()
        out.add(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


def test_env_nice_renices_every_thread_and_says_when_it_cannot_lower_it(monkeypatch):
    from wamkit.core.cpu_pinning import can_lower_nice, change_nice, own_nice
    from wamkit.core.errors import UserError

    p = threaded_child()
    try:
        assert p.stdout.readline().strip() == "up"
        assert change_nice(p.pid, 0, 7) == 7 and thread_nices(p.pid) == {7}
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "more"
        assert thread_nices(p.pid) == {7} and len(os.listdir(f"/proc/{p.pid}/task")) == 5   # inherited
        assert change_nice(p.pid, 7, 7) == 7                    # unchanged: not touched
        if can_lower_nice(own_nice()):
            assert change_nice(p.pid, 7, 0) == 0 and thread_nices(p.pid) == {own_nice()}   # back to ours
        def refuse(*a):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(os, "setpriority", refuse)
        with pytest.raises(UserError, match="env_nice: cannot set niceness 3 .* needs root or CAP_SYS_NICE"):
            change_nice(p.pid, 0, 3)
        monkeypatch.undo()
        p.stdin.write("\n")
        p.stdin.flush()
    finally:
        p.wait(timeout=30)


def test_env_nice_is_refused_where_ray_places_the_env_workers(tmp_path):
    from wamkit.core.errors import UserError
    from wamkit.eval.runner import run_eval

    made = []
    cfg = load_config(EvalConfig, None, ["runtime=ray", "env_nice=5", "env=metaworld", f"out={tmp_path}"])
    with pytest.raises(UserError, match="env_nice=5 renices the env worker processes of this host; runtime=ray"):
        run_eval(cfg, env_workers=lambda *a: made.append(a) or [])
    assert made == []     # refused before any worker was made


def test_env_nice_is_checked_as_a_config_key_and_per_bench_row(monkeypatch):
    from wamkit.core.errors import ConfigError
    from wamkit.eval import bench
    from wamkit.eval.bench import check_nice_rows, row_config, row_values

    for bad in ("-1", "20"):
        with pytest.raises(ConfigError, match="env_nice"):
            load_config(EvalConfig, None, [f"env_nice={bad}"])
    base = load_config(EvalConfig, None, ["inference=server", "num_envs=4", "env_nice=5"])
    assert row_config({"auto": base}, "auto @ env_nice=10").env_nice == 10
    rows = ["auto", "auto @ env_nice=10", "B=2, P=2 @ server.reserve_cpus=1"]
    assert row_values(base, rows, "env_nice") == ["5", "10", "5"]
    assert row_values(base, rows, "server.reserve_cpus") == ["0", "0", "1"]
    check_nice_rows(base, ["auto", "auto @ env_nice=5"])           # one niceness: nothing to lower
    monkeypatch.setattr("wamkit.eval.bench.can_lower_nice", lambda to: False)
    check_nice_rows(base, ["auto", "auto @ env_nice=5"])
    with pytest.raises(ConfigError, match=r"env_nice differs between rows \(\[5, 10\]\).*whole bench"):
        check_nice_rows(base, rows)
    assert bench.ROW_KEYS.count("env_nice") == 1


def process_env(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with."""
    from processes import start_environ

    return {k.decode(): v.decode() for k, v in start_environ(pid).items()}


def test_torch_threads_never_outnumber_the_cpus_a_process_may_use():
    import subprocess
    import sys

    from wamkit.core.cpu_pinning import torch_threads

    assert torch_threads() == min(4, len(usable_cpus())) and torch_threads(3) == 3
    # a process pinned to one CPU (os.cpu_count() still counts them all): one thread, unless configured
    code = ("import os; os.sched_setaffinity(0, [max(os.sched_getaffinity(0))])\n"
            "from wamkit.core.cpu_pinning import torch_threads\n"
            "print(os.cpu_count(), torch_threads(), torch_threads(2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(os.cpu_count()), "1", "2"]


def test_a_server_that_may_be_pinned_starts_with_passive_openmp_threads(monkeypatch):
    """Pinned while it runs, a process whose OpenMP team spins for the CPUs it saw at start stalls (10.7 ms a
    parallel region against 43 us, bench/bench_omp_pin.py): servers pinned at start, or that a bench row may pin
    later (pinnable), start with OMP_WAIT_POLICY=PASSIVE; others, and a user's own choice, are left alone."""
    from wamkit.eval.bench import pins_servers
    from wamkit.serve.workers import WamkitServerWorker

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    w = WamkitServerWorker("fixed-cost")
    assert "OMP_WAIT_POLICY" not in w.child_env()
    w.set_cpus([0])
    assert w.child_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    w.set_cpus(None)
    w.pinnable = True
    assert w.child_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert WamkitServerWorker("fixed-cost", env={"OMP_WAIT_POLICY": "ACTIVE"}).child_env()["OMP_WAIT_POLICY"] \
        == "ACTIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert w.child_env()["OMP_WAIT_POLICY"] == "ACTIVE"
    base = load_config(EvalConfig, None, ["inference=server"])
    assert not pins_servers(base, ["auto", "B=2, P=1 @ auto_probe=false", "auto @ server.reserve_cpus=0"])
    assert not pins_servers(base, None)
    assert pins_servers(base, ["auto", "auto @ server.reserve_cpus=2"])
    assert pins_servers(load_config(EvalConfig, None, ["inference=server", "server.reserve_cpus=1"]), ["auto"])


def test_a_process_and_all_its_threads_are_pinned():
    p = threaded_child()
    try:
        assert p.stdout.readline().strip() == "up"
        first = [sorted(usable_cpus())[0]]
        pin_process(p.pid, first)
        assert thread_cpus(p.pid) == {tuple(first)}
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "more"
        assert thread_cpus(p.pid) == {tuple(first)} and len(os.listdir(f"/proc/{p.pid}/task")) == 5
        p.stdin.write("\n")
        p.stdin.flush()
    finally:
        p.wait(timeout=30)


def test_a_started_server_is_pinned_at_every_start():
    from wamkit.eval.inference import start_server_workers

    cfg = load_config(EvalConfig, None, ["inference=server", "server.reserve_cpus=1"])
    server_cpus, _ = split_cpus(1)
    (w,) = start_server_workers("fixed-cost", {"per_obs_ms": 0, "action_dim": 2, "horizon": 2, "base_ms": 1},
                                cfg.server)
    try:
        assert w.cpus == server_cpus and thread_cpus(w.pid) == {tuple(server_cpus)}   # torch's threads included
        assert process_env(w.pid).get("OMP_WAIT_POLICY") == "PASSIVE"   # its OpenMP threads sleep, never spin
        w.stop()
        w.start().wait_healthy(120)
        assert thread_cpus(w.pid) == {tuple(server_cpus)}
        w.set_cpus(None)                 # a shared server, for a run without the split: every CPU again
        assert thread_cpus(w.pid) == {tuple(usable_cpus())}
    finally:
        w.stop()


@pytest.mark.slow
@pytest.mark.metaworld
def test_an_env_worker_is_pinned_now_and_after_a_restart():
    from wamkit.envs.worker import EnvWorker

    env_cpus = split_cpus(1)[1]
    w = EnvWorker("metaworld", {"tasks": "reach-v3", "image_size": 32}, index=0)
    try:
        w.start()
        assert thread_cpus(w.pid) == {tuple(usable_cpus())}     # not pinned until asked
        w.set_cpus(env_cpus)
        assert thread_cpus(w.pid) == {tuple(env_cpus)}
        w.kill()
        w.close()
        w.start()                                                # a restart: pinned before the simulator starts
        assert thread_cpus(w.pid) == {tuple(env_cpus)}
        w.set_cpus(None)
        assert thread_cpus(w.pid) == {tuple(usable_cpus())}
        w.set_nice(9)                                            # env_nice: every thread, now and after a restart
        assert thread_nices(w.pid) == {9}
        w.kill()
        w.close()
        w.start()
        assert thread_nices(w.pid) == {9}
    finally:
        w.close()


def test_a_bench_row_may_set_its_own_cpu_split_and_nothing_that_changes_the_plan():
    from wamkit.core.errors import ConfigError
    from wamkit.eval.bench import _slug, row_config

    base = load_config(EvalConfig, None, ["inference=server", "num_envs=4"])
    known = {"auto": base}
    assert row_config(known, "auto") is base
    cfg = row_config(known, "auto @ server.reserve_cpus=1 auto_probe=false")
    assert cfg.server.reserve_cpus == 1 and cfg.auto_probe is False and cfg.num_envs == 4
    assert base.server.reserve_cpus == 0            # the plain row's config is not touched
    for bad in ("auto @ num_envs=8", "auto @ server.policy=zero", "auto @ server.reserve_cpus"):
        with pytest.raises(ConfigError, match="a row may set only server.reserve_cpus"):
            row_config(known, bad)
    assert _slug("B=16, P=2 @ server.reserve_cpus=2") == "B16_P2__server-reserve_cpus2"
    assert _slug("auto @ server.reserve_cpus=1 env_nice=3") == "auto__server-reserve_cpus1__env_nice3"
