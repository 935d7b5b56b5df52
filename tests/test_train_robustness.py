"""`wamkit train` / `wamkit export` where a probe found them fragile: progress on a console that is not a terminal,
signals sent to the whole process group (DataLoader workers), out= directories wamkit did not write, checkpoint
weights damaged on disk, an EMA run resumed without EMA. Small: TinyPolicy on synthetic data, a few steps."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_support import BASE_ARGS, cli_fails, env, losses
from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, UserError
from wamkit.train.checkpoint import list_checkpoints
from wamkit.train.config import TrainConfig
from wamkit.train.trainer import train


def cfg_of(tmp: Path, *args: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*BASE_ARGS, f"out={tmp}", *args])


# ------------------------------------------------------------------------------------------------ console

@pytest.mark.parametrize("progress", ["true", "false"])
def test_progress_is_a_plain_line_per_log_window_without_a_terminal(tmp_path, capsys, progress):
    """nohup, Slurm, CI: the rich bar drew nothing until the run ended (and progress=false printed nothing at all);
    the header was wrapped at 80 columns. Now one plain line per log window (docs: log_every is the console's cadence
    too; progress=false turns the bar off, not the lines) and the header on one line."""
    capsys.readouterr()
    train(cfg_of(tmp_path, "steps=4", "batch_size=8", "log_every=2", f"progress={progress}"))
    lines = capsys.readouterr().out.splitlines()
    header = [ln for ln in lines if ln.startswith("wamkit train: ")]
    assert len(header) == 1 and header[0].endswith("steps 0->4"), lines
    rows = [ln for ln in lines if ln.startswith("train step ")]
    assert [r.split(" | ")[0] for r in rows] == ["train step 2/4", "train step 4/4"], lines
    assert " | loss " in rows[0] and " steps/s | " in rows[0] and " samples/s | ETA " in rows[0], rows[0]


# ------------------------------------------------------------------------------------------------ signals

def _start_group(out: Path, *args: str) -> subprocess.Popen:
    """`wamkit train` with 2 DataLoader workers in a process group of its own (SIGINT not ignored), once it logged
    two steps."""
    p = subprocess.Popen([sys.executable, "-m", "wamkit.cli.main", "train", *BASE_ARGS, "steps=100000", "batch_size=8",
                          "save_every=0", "log_every=1", "num_workers=2", f"out={out}", *args],
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (out / "train_log.jsonl").exists() or len(losses(out)) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    return p


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(c) for c in fh.read().split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_process_group_stops_the_run_like_one_to_the_main_process(tmp_path, sig, code):
    """`kill -- -PGID` (a job's kill, Ctrl-C) with DataLoader workers: the workers died of the SIGTERM first and the
    main process failed at once ("DataLoader worker (pid ...) is killed by signal: Terminated", 40 lines, no
    checkpoint). Now the workers leave the signal to the main process: SIGTERM finishes the step, checkpoints it and
    exits 143; SIGINT exits 130; no worker is left."""
    out = tmp_path / "run"
    p = _start_group(out)
    try:
        workers = _children(p.pid)
        assert len(workers) == 2
        os.killpg(p.pid, sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == code, err
    assert "Traceback" not in err and "killed by signal" not in err, err
    if sig == signal.SIGTERM:
        n = max(losses(out))
        assert [c.name for c in list_checkpoints(out / "checkpoints")] == [f"step-{n:06d}"]
    assert not [w for w in workers if _running(w)]


def test_workers_do_not_outlive_a_killed_main_process(tmp_path):
    out = tmp_path / "run"
    p = _start_group(out)
    workers = _children(p.pid)
    p.kill()
    p.communicate(timeout=60)
    deadline = time.monotonic() + 30           # the loader's watchdog notices the lost parent (every 5 s)
    while any(_running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [w for w in workers if _running(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left


def _worker_like():
    from wamkit.train.data import leave_signals_to_the_main_process

    leave_signals_to_the_main_process(0)
    time.sleep(60)


def test_a_worker_ignores_sigterm_from_others_and_exits_on_its_parents():
    """The loader ends a worker that did not stop with SIGTERM (`terminate()`): that one still ends it."""
    import multiprocessing

    w = multiprocessing.get_context("fork").Process(target=_worker_like, daemon=True)
    w.start()
    try:
        time.sleep(0.5)                                          # its handler is installed
        subprocess.run(["kill", "-TERM", str(w.pid)], check=True)   # sent by another process: ignored
        w.join(1.0)
        assert w.is_alive()
        os.kill(w.pid, signal.SIGTERM)                           # sent by its parent
        w.join(10)
        assert w.exitcode == 0
    finally:
        if w.is_alive():
            w.kill()


# ------------------------------------------------------------------------------------------------ out=

def test_an_unset_out_is_refused(tmp_path, monkeypatch):
    """out= empty trained into the current directory; YAML `out: null` into a directory named "None"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="out must name the run directory, got ''"):
        load_config(TrainConfig, None, [*BASE_ARGS, "steps=1", "out="])
    y = tmp_path / "t.yaml"
    y.write_text("out: null\n")
    with pytest.raises(ConfigError, match="out must name the run directory, got null"):
        load_config(TrainConfig, y, [*BASE_ARGS, "steps=1"])
    assert list(tmp_path.iterdir()) == [y]


@pytest.mark.parametrize("flag", ["", "overwrite=true", "resume=true"])
def test_a_directory_wamkit_did_not_write_is_refused(tmp_path, capsys, flag):
    """A config.json of something else was overwritten, a tb/ of something else written into, and overwrite=true
    deleted that tb/ whole."""
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "mine.txt").write_text("keep")
    (tmp_path / "config.json").write_text('{"model": "not wamkit"}')
    cli_fails(capsys, ["train", *BASE_ARGS, "steps=2", "batch_size=8", f"out={tmp_path}", *([flag] if flag else [])],
              f"out={tmp_path} holds files that wamkit train did not write (config.json, tb)")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "mine.txt", "tb"]
    assert (tmp_path / "config.json").read_text() == '{"model": "not wamkit"}'


def test_hidden_files_and_a_jobs_own_log_do_not_make_a_directory_foreign(tmp_path):
    """Another rank's write test (.wamkit-write-test-*), a .gitkeep, the job log a scheduler writes into out= before
    the run starts: none is a file of something else (a multi-rank start could be refused when one rank listed the
    directory during another's write test)."""
    for name in (".gitkeep", ".wamkit-write-test-x", "slurm-1.out", "job.err"):
        (tmp_path / name).write_text("")
    train(cfg_of(tmp_path, "steps=1", "batch_size=8"))
    assert sorted(losses(tmp_path)) == [1]


def test_overwrite_removes_only_what_a_run_wrote(tmp_path):
    train(cfg_of(tmp_path, "steps=2", "batch_size=8"))
    (tmp_path / "tb" / "mine.txt").write_text("keep")
    (tmp_path / "checkpoints" / "notes.txt").write_text("keep")
    (tmp_path / "slurm-1.out").write_text("keep")
    old_events = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    train(cfg_of(tmp_path, "steps=1", "batch_size=8", "overwrite=true"))
    assert sorted(losses(tmp_path)) == [1]
    assert [c.name for c in list_checkpoints(tmp_path / "checkpoints")] == ["step-000001"]
    assert all(not p.exists() for p in old_events)
    for f in ("tb/mine.txt", "checkpoints/notes.txt", "slurm-1.out"):
        assert (tmp_path / f).read_text() == "keep", f


# ------------------------------------------------------------------------------------------------ checkpoints

@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ema") / "run"
    train(cfg_of(out, "steps=2", "batch_size=8", "save_every=2", "ema=0.9"))
    return out


def _copy(run: Path, tmp: Path) -> tuple[Path, Path]:
    import shutil

    dst = tmp / "run"
    shutil.copytree(run, dst)
    return dst, dst / "checkpoints" / "step-000002"


def _poison(part: Path) -> tuple[Path, str]:
    """Overwrite the first bytes of the last tensor of part/'s safetensors file with 0xff (NaN in float32): the
    file stays readable. Returns (file, tensor name)."""
    f = next(part.glob("*.safetensors"))
    b = bytearray(f.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    header = {k: v for k, v in json.loads(b[8:8 + n]).items() if k != "__metadata__"}
    name = max(header, key=lambda k: header[k]["data_offsets"][1])
    start = 8 + n + header[name]["data_offsets"][0]
    b[start:start + 8] = b"\xff" * 8
    f.write_bytes(bytes(b))
    return f, name


@pytest.mark.parametrize("part", ["model", "ema"])
def test_non_finite_checkpoint_weights_are_one_line_naming_file_and_tensor(tmp_path, capsys, ema_run, part):
    """Bytes damaged on disk load as NaN weights without complaint: the resumed run then stopped blaming its data
    or lr, and export wrote a policy that predicts NaN."""
    run, step = _copy(ema_run, tmp_path)
    f, name = _poison(step / part)
    cli_fails(capsys, ["export", str(run), str(tmp_path / "export"), f"weights={part}"], str(f), repr(name),
              "NaN/inf")
    assert not (tmp_path / "export").exists()
    cli_fails(capsys, ["train", *BASE_ARGS, "steps=4", "batch_size=8", "ema=0.9", "resume=true", f"out={run}"],
              str(f), repr(name), "NaN/inf")
    assert sorted(losses(run)) == [1, 2]


def test_resuming_an_ema_run_without_ema_is_refused(tmp_path, capsys, ema_run):
    """The EMA weights were silently dropped (export then took the raw weights); the reverse was already refused."""
    run, step = _copy(ema_run, tmp_path)
    with pytest.raises(UserError, match=r"was trained with ema=0\.9, this run asks for ema=0\.0"):
        train(cfg_of(run, "steps=4", "batch_size=8", "resume=true"))
    assert sorted(losses(run)) == [1, 2]


def test_a_corrupt_config_json_in_the_checkpoint_is_named(tmp_path, capsys, ema_run):
    """It silently skipped the check of what a resumed run must keep (policy, policy_args, ...)."""
    run, step = _copy(ema_run, tmp_path)
    (step / "config.json").write_text('{"policy": ')
    cli_fails(capsys, ["train", *BASE_ARGS, "steps=4", "batch_size=8", "ema=0.9", "resume=true", f"out={run}"],
              str(step / "config.json"))
