"""Multi-process training (real torchrun + gloo ranks on CPU): 2 ranks == 1 rank, exact stop/resume on 2 ranks,
a 2-rank checkpoint resumed on 1 rank, the meta-device build initialized shard by shard on 2 ranks."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from test_train_support import BASE_ARGS, TESTS, env, losses, run_train
from wamkit.core.config import load_config
from wamkit.train.config import TrainConfig
from wamkit.train.trainer import train

pytestmark = pytest.mark.slow


def close(a: dict, b: dict, steps, rtol=1e-5, atol=1e-6):
    for s in steps:
        assert abs(a[s] - b[s]) <= atol + rtol * abs(b[s]), (s, a[s], b[s])


def test_two_ranks_match_one_rank_and_resume_on_one_rank(tmp_path):
    """2 ranks (shard=auto: FSDP2) == 1 rank (shard=auto: none, the plain module); the 2-rank FSDP2 checkpoint
    resumes on one rank under shard=none, and a 1-rank shard=none checkpoint resumes on 2 FSDP2 ranks."""
    common = ["steps=20", "batch_size=8", "grad_accum=2", "save_every=10", "keep_last=2"]
    two, one = tmp_path / "two", tmp_path / "one"
    run_train([*common, f"out={two}"], nproc=2)
    train(load_config(TrainConfig, None, [*BASE_ARGS, *common, f"out={one}"]))
    a, b = losses(two), losses(one)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    close(a, b, range(1, 21))
    assert a[20] < a[1]
    # the 2-rank checkpoint of step 10, resumed on one rank (DCP reshards; sampler position translated)
    re = tmp_path / "re"
    (re / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step-000010", re / "checkpoints" / "step-000010")
    train(load_config(TrainConfig, None, [*BASE_ARGS, *common, f"out={re}", "resume=true"]))
    c = losses(re)
    assert sorted(c) == list(range(11, 21))
    close(c, a, range(11, 21))
    # and the other way: the 1-rank shard=none checkpoint of step 10, resumed on 2 FSDP2 ranks
    re2 = tmp_path / "re2"
    (re2 / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step-000010", re2 / "checkpoints" / "step-000010")
    run_train([*common, f"out={re2}", "resume=true", "shard=fsdp"], nproc=2)
    d = losses(re2)
    assert sorted(d) == list(range(11, 21))
    close(d, a, range(11, 21))


def test_two_rank_stop_and_resume_is_exact(tmp_path):
    common = ["steps=10", "batch_size=8", "grad_accum=2", "save_every=0", "ema=0.9", "policy_args.noise=0.1",
              "num_workers=1"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_train([*common, f"out={full}"], nproc=2)
    run_train([*common, f"out={part}", "stop_at=4"], nproc=2)
    run_train([*common, f"out={part}", "resume=true"], nproc=2)
    a, b = losses(full), losses(part)
    assert sorted(b) == list(range(1, 11))
    assert [a[s] for s in range(1, 11)] == [b[s] for s in range(1, 11)]


def test_meta_build_sharded_on_two_ranks_equals_a_materialized_build():
    """Each of 2 ranks initializes only its shards of a meta-built wam-ref; gathered, they are the weights of a
    plain CPU build (check_meta_init in test_train_support)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(TESTS / "test_train_support.py"), "meta-init"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.count("meta-init ok") == 2


def test_two_ranks_with_step_cost_options_match_one_rank_default(tmp_path):
    """FSDP2 on 2 gloo ranks with fused AdamW on the DTensor shards, activation checkpointing of every unit, weights
    kept gathered between forward and backward and manual GC: the losses of a plain 1-rank run."""
    common = ["steps=6", "batch_size=8", "save_every=0"]
    two, one = tmp_path / "two", tmp_path / "one"
    run_train([*common, f"out={two}", "optimizer_impl=fused", "activation_checkpointing=full",
               "reshard_after_forward=false", "gc_every=2"], nproc=2)
    train(load_config(TrainConfig, None, [*BASE_ARGS, *common, f"out={one}"]))
    a, b = losses(two), losses(one)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    close(a, b, range(1, 7))


def test_sigterm_to_the_nproc_launcher_stops_torchrun_and_every_rank(tmp_path):
    """`wamkit train nproc=2` relaunches itself under torchrun: a SIGTERM to it (a scheduler, `timeout`) stops torchrun
    and both ranks and exits 143; without forwarding, the launcher died alone and the ranks kept training (and
    writing checkpoints) as orphans."""
    import os
    import signal
    import time

    from processes import descendants, running

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "wamkit.cli.main", "train", *BASE_ARGS, "steps=100000", "batch_size=8",
           "save_every=0", "num_workers=1", f"out={out}", "nproc=2"]
    err = tmp_path / "stderr"                     # a file, not a pipe: orphaned ranks would hold a pipe open
    with open(err, "w") as fh:
        p = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=fh)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        log = out / "train_log.jsonl"
        while time.monotonic() < deadline and not (log.exists() and log.read_text().count("\n") >= 2):
            assert p.poll() is None, err.read_text()[-3000:]
            time.sleep(0.2)
        assert log.exists(), "training did not start"
        kids = descendants(p.pid)                 # torchrun, its 2 ranks, their DataLoader workers
        assert len(kids) >= 3, kids
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=90)
        stderr = err.read_text()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(running(k) for k in kids):
            time.sleep(0.2)
        assert not [k for k in kids if running(k)], "torchrun or a rank outlived the launcher"
        assert p.returncode == 143, stderr[-3000:]
        assert "terminated (SIGTERM)" in stderr
    finally:
        for k in [p.pid, *kids]:
            if running(k):
                os.kill(k, signal.SIGKILL)
