"""Training layer, single process (fast): schedule, param groups, config checks that fail before training, a real
one-rank FSDP2 run with checkpoints, exact resume, export -> load -> predict, LeRobot data end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from test_train_support import BASE_ARGS, TinyPolicy, cli_fails as _cli_fails, losses
from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, UserError
from wamkit.core.types import Observation
from wamkit.train.checkpoint import list_checkpoints
from wamkit.train.config import TrainConfig
from wamkit.train.optim import lr_factor, param_groups, select_trainable
from wamkit.train.trainer import train


def cfg_of(tmp: Path, *args: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*BASE_ARGS, f"out={tmp}", *args])


# ------------------------------------------------------------------------------------------------ pieces

def test_lr_schedule_warmup_then_linear_decay():
    assert lr_factor(0, 4, None, 12) == pytest.approx(0.25)
    assert lr_factor(3, 4, None, 12) == pytest.approx(1.0)
    assert lr_factor(4, 4, None, 12) == pytest.approx(1.0)
    assert lr_factor(8, 4, None, 12) == pytest.approx(0.5)
    assert lr_factor(12, 4, None, 12) == pytest.approx(0.0)
    assert lr_factor(100, 4, 0, 12) == 1.0            # decay=0: constant after warmup
    assert lr_factor(6, 4, 4, 100) == pytest.approx(0.5)
    assert lr_factor(50, 4, 4, 100) == 0.0


def test_param_groups_multipliers_and_weight_decay():
    pol = TinyPolicy()
    select_trainable(pol.module, ["inp.*", "blocks.0.*", "out.*"])
    groups = param_groups(pol.module, {"inp.*": 5.0, "out.*": 5.0}, 0.05)
    by = {(g["lr_mult"], g["weight_decay"]): len(g["params"]) for g in groups}
    # inp/out: 2 weights (decay) + 2 biases (no decay) at 5x; blocks.0: fc1/fc2 weights decay, 4 biases/norm no decay
    assert by == {(5.0, 0.05): 2, (5.0, 0.0): 2, (1.0, 0.05): 2, (1.0, 0.0): 4}
    assert not any(p.requires_grad for n, p in pol.module.named_parameters() if n.startswith("blocks.1"))


def test_config_keys_and_values():
    c = load_config(TrainConfig, None, ["betas=0.9,0.95", "lr_multipliers.out.*=3", "trainable=a.*,b.*",
                                        "policy_args.width=8", "decay=none"])
    assert c.betas == (0.9, 0.95) and c.lr_multipliers == {"out.*": 3.0}
    assert c.trainable == ["a.*", "b.*"] and c.policy_args == {"width": 8} and c.decay is None
    with pytest.raises(ConfigError):
        load_config(TrainConfig, None, ["batch_sise=3"])
    with pytest.raises(ConfigError):
        load_config(TrainConfig, None, ["ema=1.5"])


# ------------------------------------------------------------------------------------------------ bad configs

@pytest.mark.parametrize("args, match", [
    (["trainable=inp.*,decoder.*"], "match no parameter"),
    (["lr_multipliers.nope.*=2"], "match no parameter"),
    (["fps=20"], "fps"),
    (["fps=none"], "fps is not set"),
    (["batch_size=7", "grad_accum=2"], "not divisible"),
    (["horizon=8"], "horizon"),
    (["cameras=wrist_image"], "lacks camera"),
    (["policy=zero"], "not trainable"),
    (["policy=test_train_support:NoSuchPolicy"], "cannot import"),
])
def test_bad_config_fails_before_training(tmp_path, args, match):
    cfg = cfg_of(tmp_path, "steps=2", "batch_size=4", *args)
    with pytest.raises(UserError, match=match):
        train(cfg)
    assert not (tmp_path / "train_log.jsonl").exists()      # nothing ran
    assert not list_checkpoints(tmp_path / "checkpoints")


# ------------------------------------------------------------------------------------------------ runs

def test_single_rank_run_logs_checkpoints_and_learns(tmp_path):
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    s = train(cfg_of(tmp_path, "steps=20", "batch_size=8", "save_every=5", "keep_last=2", "ema=0.9", "num_workers=2"))
    assert s["steps"] == 20
    # its DataLoader workers are stopped when train() returns, not whenever the garbage collector frees the loader
    assert {p.pid for p in multiprocessing.active_children()} == before
    log = losses(tmp_path)
    assert sorted(log) == list(range(1, 21))
    assert np.mean([log[i] for i in range(16, 21)]) < 0.5 * np.mean([log[i] for i in range(1, 5)])
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step-000015", "step-000020"]               # keep_last=2, no .tmp left behind
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    ck = tmp_path / "checkpoints" / "step-000020"
    for f in ("model", "ema", "optim", "trainer_state.json", "rng/rank-00000.json", "config.json", "policy.json",
              "action_pipeline.json"):
        assert (ck / f).exists(), f
    row = json.loads((tmp_path / "train_log.jsonl").read_text().splitlines()[-1])
    for k in ("loss", "pred_abs", "lr", "grad_norm", "samples_per_s", "steps_per_s"):
        assert k in row
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_stop_and_resume_gives_identical_losses(tmp_path):
    """Noise in the loss (torch RNG), grad accumulation and EMA: a run stopped at step 5 and resumed reproduces the
    uninterrupted run exactly."""
    common = ["steps=12", "batch_size=8", "grad_accum=2", "ema=0.95", "save_every=0",
              "policy_args.noise=0.1", "num_workers=1"]
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg_of(full, *common))
    train(cfg_of(part, *common, "stop_at=5"))
    assert sorted(losses(part)) == [1, 2, 3, 4, 5]
    train(cfg_of(part, *common, "resume=true"))
    a, b = losses(full), losses(part)
    assert sorted(b) == list(range(1, 13))
    assert [a[i] for i in range(1, 13)] == [b[i] for i in range(1, 13)]


def test_sigterm_checkpoints_the_step_under_way_and_resume_continues_exactly(tmp_path):
    """A probe's finding: SIGTERM (a scheduler's preemption) ended a one-rank run at once, losing up to save_every
    steps. Now the step under way finishes, is logged and checkpointed, the exit status is 143, and resume=true
    continues as if nothing had happened."""
    import signal
    import subprocess
    import sys
    import time

    from test_train_support import env, run_train

    common = ["steps=100000", "batch_size=8", "save_every=0", "log_every=4", "policy_args.noise=0.1"]
    part = tmp_path / "part"
    p = subprocess.Popen([sys.executable, "-m", "wamkit.cli.main", "train", *BASE_ARGS, *common, f"out={part}"],
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (part / "train_log.jsonl").exists() or len(losses(part)) < 2:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    logged = sorted(losses(part))
    n = logged[-1]                                  # the step under way when the signal came: its window is logged
    assert n > 4 and logged == sorted(set(range(4, n + 1, 4)) | {n})
    assert [c.name for c in list_checkpoints(part / "checkpoints")] == [f"step-{n:06d}"]
    assert "SIGTERM at step" in out
    per_step = [a for a in common if not a.startswith("log_every")] + ["log_every=1"]
    full = tmp_path / "full"                        # (in processes like the first: the same threads, the same sums)
    run_train([*per_step, "resume=true", f"stop_at={n + 2}", f"out={part}"])
    run_train([*per_step, f"stop_at={n + 2}", f"out={full}"])
    a, b = losses(full), losses(part)
    assert sorted(b)[-3:] == [n, n + 1, n + 2] and [a[n + 1], a[n + 2]] == [b[n + 1], b[n + 2]]


def test_export_load_predict(tmp_path):
    from wamkit.train.export import load_trained_policy

    train(cfg_of(tmp_path, "steps=6", "batch_size=8", "ema=0.5"))
    pol, which, step_dir = load_trained_policy(tmp_path)
    assert which == "ema" and step_dir.name == "step-000006"
    # the loaded EMA weights are the checkpoint's (safetensors), and the pipeline carries the quantile stats
    from safetensors.torch import load_file

    ema = {}
    for f in (step_dir / "ema").glob("*.safetensors"):
        ema.update(load_file(str(f)))
    torch.testing.assert_close(pol.module.state_dict()["out.weight"], ema["out.weight"])
    assert any(s.name == "quantile_normalize" for s in pol.action_pipeline.steps)
    g = np.random.default_rng(0)
    obs = [Observation(images={"image": g.integers(0, 256, (8, 8, 3), dtype=np.uint8)},
                       state=g.normal(size=3).astype(np.float32), task="x") for _ in range(3)]
    a = pol.predict(obs, [0, 1, 2])
    assert a.shape == (3, 4, 7) and a.dtype == np.float32 and np.isfinite(a).all()
    model_w, _, _ = load_trained_policy(tmp_path, weights="model")
    assert not torch.equal(model_w.module.state_dict()["out.weight"], pol.module.state_dict()["out.weight"])


def test_export_dir_is_loadable_by_make_policy(tmp_path):
    from wamkit.policies import make_policy, register_policy

    register_policy("tiny-test", "test_train_support:TinyPolicy")
    from wamkit.train.export import export_checkpoint

    train(cfg_of(tmp_path / "run", "steps=4", "batch_size=8"))
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    pol = make_policy(str(out))
    g = np.random.default_rng(0)
    obs = [Observation(images={"image": g.integers(0, 256, (8, 8, 3), dtype=np.uint8)},
                       state=g.normal(size=3).astype(np.float32), task="x")]
    assert pol.predict(obs, [0]).shape == (1, 4, 7)
    ref, _, _ = __import__("wamkit.train.export", fromlist=["x"]).load_trained_policy(tmp_path / "run")
    np.testing.assert_array_equal(pol.predict(obs, [0]), ref.predict(obs, [0]))


def test_export_guards_its_out_and_refuses_damaged_exports(tmp_path):
    """A probe's findings (session 30): export wrote into any directory (a dataset, the checkpoint itself) and kept
    an earlier export's stale files; an export missing action_pipeline.json served actions that were never
    denormalized; a truncated model.safetensors or a manifest that is not an object was a traceback; weights=auto
    on a checkpoint of an EMA run whose ema/ was lost exported the raw weights without a word."""
    import shutil

    from wamkit.policies import make_policy, register_policy
    from wamkit.train.export import export_checkpoint, load_trained_policy

    register_policy("tiny-test", "test_train_support:TinyPolicy")
    train(cfg_of(tmp_path / "run", "steps=4", "batch_size=8", "ema=0.5"))
    step = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    other = tmp_path / "dataset"
    (other / "meta").mkdir(parents=True)
    with pytest.raises(UserError, match="not empty and holds no earlier export"):
        export_checkpoint(tmp_path / "run", other)
    with pytest.raises(UserError, match="is the checkpoint"):
        export_checkpoint(step, step)
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "stale").write_text("x")
    export_checkpoint(tmp_path / "run", out)                            # an earlier export is replaced whole
    assert not (out / "tokenizer").exists() and make_policy(str(out)).spec.name == "tiny-test"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "export", "run"]   # no temporary dirs left
    for damage, match in [(lambda d: (d / "action_pipeline.json").unlink(), "action_pipeline.json, named in"),
                          (lambda d: (d / "model.safetensors").write_bytes(b"\x05\x00" * 100), "corrupt or incomplete"),
                          (lambda d: (d / "wamkit_policy.json").write_text("[]"), "expected a JSON object")]:
        bad = tmp_path / "bad"
        shutil.copytree(out, bad)
        damage(bad)
        with pytest.raises(UserError, match=match):
            make_policy(str(bad))
        shutil.rmtree(bad)
    lost = tmp_path / "lost-ema"
    shutil.copytree(step, lost)
    shutil.rmtree(lost / "ema")
    with pytest.raises(UserError, match="trained with EMA but has no ema/"):
        load_trained_policy(lost)
    assert load_trained_policy(lost, weights="model")[1] == "model"
    with pytest.raises(UserError, match="is a training run or checkpoint, not a servable policy: `wamkit export"):
        make_policy(str(tmp_path / "run"))


# ------------------------------------------------------------------------------------------------ run dir reuse

def test_existing_out_is_refused_unless_resume_or_overwrite(tmp_path):
    """A second run into the same out= would append to the old log and leave the old newest checkpoint for export."""
    train(cfg_of(tmp_path, "steps=3", "batch_size=8"))
    first = list_checkpoints(tmp_path / "checkpoints")
    with pytest.raises(UserError, match="already holds a training run.*resume=true.*overwrite=true"):
        train(cfg_of(tmp_path, "steps=2", "batch_size=8"))
    assert list_checkpoints(tmp_path / "checkpoints") == first          # nothing touched
    s = train(cfg_of(tmp_path, "steps=2", "batch_size=8", "overwrite=true"))
    assert sorted(losses(tmp_path)) == [1, 2]                           # the old log is gone, not appended to
    assert s["checkpoint"] == str(list_checkpoints(tmp_path / "checkpoints")[-1])
    assert len(list_checkpoints(tmp_path / "checkpoints")) == 1
    with pytest.raises(ConfigError, match="contradict"):
        cfg_of(tmp_path, "resume=true", "overwrite=true")


def test_resume_with_another_model_is_refused_naming_the_keys(tmp_path, capsys):
    """A probe's finding: resume=true with another policy_args (width, depth, horizon) failed with a size-mismatch
    or missing-key traceback after the model was built; steps at or below the checkpoint's step trained nothing and
    said nothing. Now: one line naming the keys before anything is built; a warning for the empty schedule."""
    train(cfg_of(tmp_path, "steps=3", "batch_size=8", "save_every=3"))
    with pytest.raises(UserError, match=r"resume=true: .*step-0+3 was trained with policy_args=\{\}.*asks for "
                                        r"policy_args=\{\"width\": 64\}"):
        train(cfg_of(tmp_path, "steps=6", "batch_size=8", "resume=true", "policy_args.width=64"))
    with pytest.raises(UserError, match="horizon=8"):
        train(cfg_of(tmp_path, "steps=6", "batch_size=8", "resume=true", "horizon=8"))
    capsys.readouterr()
    s = train(cfg_of(tmp_path, "steps=3", "batch_size=8", "resume=true"))
    assert "at or past this run's last step (3): nothing to train" in capsys.readouterr().out
    assert s["checkpoint"].endswith("step-000003")
    s = train(cfg_of(tmp_path, "steps=5", "batch_size=8", "resume=true", "lr=1e-3"))   # lr may change
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5]
    from test_train_support import run_train

    p = run_train(["steps=5", "batch_size=8", "resume=true", f"out={tmp_path}"])   # the CLI says it once (was twice)
    assert p.stdout.count("nothing to train") == 1, p.stdout


def test_a_resume_trains_and_logs_with_its_own_lr(tmp_path):
    """A probe's finding: `resume=true lr=X` loaded the checkpoint's lr into the optimizer and the scheduler, so the
    run went on at the old lr, bit for bit, while train_log.jsonl reported X. Two resumes of one checkpoint, the
    same lr and 10x it: the same loss at the first resumed step (the same weights), different ones after; the
    logged lr is the lr that ran (the next checkpoint's scheduler says so)."""
    import shutil

    first = tmp_path / "first"
    train(cfg_of(first, "steps=3", "batch_size=8", "save_every=3", "warmup=0", "decay=0"))
    runs = {}
    for lr in (3e-3, 3e-2):
        out = tmp_path / f"lr{lr}"
        shutil.copytree(first, out)
        train(cfg_of(out, "steps=6", "batch_size=8", "save_every=3", "warmup=0", "decay=0", "resume=true",
                     f"lr={lr}"))
        rows = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines() if l.strip()]
        state = json.loads((list_checkpoints(out / "checkpoints")[-1] / "trainer_state.json").read_text())
        runs[lr] = ({r["step"]: r["loss"] for r in rows}, {r["step"]: r["lr"] for r in rows},
                    state["scheduler"]["base_lrs"])
    (same, same_lr, same_base), (big, big_lr, big_base) = runs[3e-3], runs[3e-2]
    assert same[4] == big[4]                         # step 4 runs on the checkpoint's weights in both
    assert same[5] != big[5] and same[6] != big[6]   # it updated them with another lr
    assert same_lr[5] == pytest.approx(3e-3) and big_lr[5] == pytest.approx(3e-2)
    ckpt = json.loads((list_checkpoints(first / "checkpoints")[-1] / "trainer_state.json").read_text())
    assert same_base == ckpt["scheduler"]["base_lrs"] and big_base == pytest.approx([10 * b for b in same_base])


def test_cli_refuses_existing_out_in_one_line(tmp_path):
    import subprocess
    import sys

    from test_train_support import env

    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "wamkit.cli.main", "train", *BASE_ARGS, f"out={tmp_path}"],
                       env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "resume=true" in p.stderr


def test_logger_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(cfg_of(tmp_path, "steps=3", "batch_size=8", "logger=wandb", "wandb_project=wamkit-test"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").iterdir())
    assert sorted(losses(tmp_path)) == [1, 2, 3]                        # the JSONL log is still written
# ------------------------------------------------------------------------------------------------ model build

@pytest.mark.parametrize("args", [{"size": "tiny", "state_dim": 4}, {"size": "tiny", "dtype": "bfloat16"}])
def test_wam_ref_is_built_on_meta_and_initialized_after_sharding(args):
    """torchtitan's order (meta build -> fully_shard -> init): the weights of a materialized build, bit for bit
    (bf16: rounded as a bf16 build followed by `.float()` is)."""
    from test_train_support import check_meta_init

    assert check_meta_init(args) > 0


def test_only_policies_that_offer_it_are_built_on_meta():
    from test_train_support import TinyPolicy
    from wamkit.train.trainer import build_for_training

    cpu = torch.device("cpu")
    pol, deferred = build_for_training("test_train_support:TinyPolicy", {}, cpu)
    assert not deferred and isinstance(pol, TinyPolicy)
    pol, deferred = build_for_training("wam-ref", {"size": "tiny", "device": "cpu"}, cpu)  # device given: as asked
    assert not deferred and not any(p.is_meta for p in pol.module.parameters())
    assert not type(pol).can_init_after_sharding({"und_path": "/some/qwen3vl"})  # pretrained: loaded at build


def test_checkpoint_policy_json_is_the_policy_manifest(tmp_path):
    """A checkpoint's policy.json and an export's wamkit_policy.json are one format (wamkit.policies.manifest);
    checkpoints written before it (policy + policy_args + spec) still export."""
    from wamkit.policies.manifest import PolicyManifest
    from wamkit.train.export import load_trained_policy

    train(cfg_of(tmp_path, "steps=2", "batch_size=8", "policy_args.width=16"))
    ck = tmp_path / "checkpoints" / "step-000002"
    m = PolicyManifest.read(ck / "policy.json")
    assert (m.format, m.policy, m.config, m.spec["name"]) == ("wamkit.policy", "test_train_support:TinyPolicy",
                                                               {"width": 16}, "tiny-test")
    (ck / "policy.json").write_text(json.dumps({"policy": m.policy, "policy_args": m.config, "spec": m.spec}))
    pol, _, _ = load_trained_policy(tmp_path)
    assert pol.width == 16
    with pytest.raises(UserError, match="unknown format"):
        PolicyManifest.from_dict({"format": "other", "policy": "zero"})
    with pytest.raises(UserError, match="newer"):
        PolicyManifest.from_dict({"format": "wamkit.policy", "version": 99, "policy": "zero"})


# ------------------------------------------------------------------------------------------------ kill and resume

def _log_steps(out: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (out / "train_log.jsonl").read_text().splitlines()]


def _tb_steps(out: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss")]


def test_resume_after_a_kill_logs_each_step_once(tmp_path):
    """A run killed after its last checkpoint had logged the steps past it; the resume logs them again. The log (and
    TensorBoard) keep each step once, with the resumed values; a torn last line of the killed run is dropped; a kill
    that left no complete checkpoint restarts from step 0 without keeping the old rows."""
    import shutil

    common = ["steps=10", "batch_size=8", "save_every=4", "keep_last=5"]
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg_of(full, *common))
    train(cfg_of(part, *common, "stop_at=7"))                     # checkpoints 4 and 7, log rows 1..7
    shutil.rmtree(part / "checkpoints" / "step-000007")            # "killed" before step 7's checkpoint was whole
    with open(part / "train_log.jsonl", "a") as fh:
        fh.write('{"step": 8, "time": 1.0, "lo')                  # and in the middle of a log line
    train(cfg_of(part, *common, "resume=true"))                    # resumes from step 4
    assert _log_steps(part) == list(range(1, 11))
    assert losses(part) == losses(full)
    assert _tb_steps(part) == list(range(1, 11))

    again = tmp_path / "again"                                     # only a .tmp checkpoint: restart from step 0
    train(cfg_of(again, *common, "stop_at=3"))
    (again / "checkpoints" / "step-000003").rename(again / "checkpoints" / "step-000003.tmp")
    train(cfg_of(again, *common, "resume=true"))
    assert _log_steps(again) == list(range(1, 11))
    assert _tb_steps(again) == list(range(1, 11))


# ------------------------------------------------------------------------------------------------ non-finite steps

class NanPolicy(TinyPolicy):
    """TinyPolicy whose loss (nan_in=loss) or gradients only (nan_in=grad: the loss stays finite) turn NaN from
    step `nan_at` on (one micro-step per step)."""

    def __init__(self, nan_at: int = 3, nan_in: str = "loss", **kw):
        super().__init__(**kw)
        self.nan_at, self.nan_in, self.calls = int(nan_at), nan_in, 0

    def sft_loss(self, batch):
        loss, metrics = super().sft_loss(batch)
        self.calls += 1
        if self.calls >= self.nan_at:
            if self.nan_in == "loss":
                loss = loss * float("nan")
            else:   # d sqrt(z)/dz at 0 is inf, times the 0 outside: NaN gradients, a finite loss
                z = sum(p.sum() for p in self.net.parameters()) * 0.0
                loss = loss + 0.0 * torch.sqrt(z)
        return loss, metrics


@pytest.mark.parametrize("nan_in", ["loss", "grad"])
def test_non_finite_step_stops_training_at_the_log_window(tmp_path, nan_in):
    """Training on past a NaN step wrote NaN checkpoints and exited 0. It stops at the first log window (no extra
    device read per step) with a UserError naming the step, and the log holds no NaN row."""
    cfg = cfg_of(tmp_path, "policy=test_train_unit:NanPolicy", f"policy_args.nan_in={nan_in}", "policy_args.nan_at=3",
                 "steps=10", "batch_size=8", "save_every=0")
    what = "loss and grad_norm" if nan_in == "loss" else "grad_norm"
    with pytest.raises(UserError, match=rf"non-finite {what} \(NaN/inf\) at step 3 .*newest checkpoint is none"):
        train(cfg)
    assert _log_steps(tmp_path) == [1, 2]
    assert not list_checkpoints(tmp_path / "checkpoints") and not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_non_finite_step_between_log_windows_is_never_checkpointed(tmp_path):
    """save_every=2 with log_every=10: the steps since the last window are checked before each save, so step 4's
    checkpoint (after NaN weights from step 3) is not written; step 2's stays the newest."""
    cfg = cfg_of(tmp_path, "policy=test_train_unit:NanPolicy", "policy_args.nan_at=3", "steps=10", "batch_size=8",
                 "save_every=2", "log_every=10")
    ck = tmp_path / "checkpoints" / "step-000002"
    with pytest.raises(UserError, match=rf"at step 3 \(steps 1..4 checked\).*newest checkpoint is {ck}"):
        train(cfg)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-000002"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


# ------------------------------------------------------------------------------------------------ disks, bad files

def test_full_disk_during_a_checkpoint_save(tmp_path, capsys, monkeypatch):
    """Disk full in the middle of a save was a 63-line traceback of torch's zip writer, and left the partial
    step-XXXXXX.tmp on the full disk. Now: one line naming the directory and its free space, the .tmp removed, the
    previous checkpoint intact."""
    import errno

    import torch.distributed.checkpoint as dcp

    real_save = dcp.save
    saves = {"n": 0}

    def save(state, *args, checkpoint_id=None, **kw):
        if checkpoint_id is not None and str(checkpoint_id).endswith("optim"):
            saves["n"] += 1
            if saves["n"] == 2:                        # step 4's optimizer state: the disk fills up half-way
                Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
                (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"\0" * 4096)
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, *args, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(dcp, "save", save)
    out = tmp_path / "run"
    ck = out / "checkpoints"
    _cli_fails(capsys, ["train", *BASE_ARGS, "steps=6", "batch_size=8", "save_every=2", f"out={out}"],
               str(ck / "step-000004.tmp"), "No space left on device", " free on that file system",
               f"newest complete one is {ck / 'step-000002'}")
    assert [p.name for p in ck.iterdir()] == ["step-000002"]


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_unusable_out_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch, kind):
    """An out= that is a file was found when the logger opened its file, after the model and the data were built
    (minutes for a large model), as a FileExistsError traceback."""
    import wamkit.train.trainer as T

    afile = tmp_path / "afile"
    afile.write_text("x")
    out = afile if kind == "file" else afile / "run"

    def no_build(*a, **k):
        raise AssertionError("the policy was built before out= was checked")

    monkeypatch.setattr(T, "build_for_training", no_build)
    _cli_fails(capsys, ["train", *BASE_ARGS, "steps=2", "batch_size=8", f"out={out}"], f"out={out}",
               "not a writable directory")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run with checkpoints at steps 2 and 4 (EMA on), copied by each corruption case."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(cfg_of(out, "steps=4", "batch_size=8", "save_every=2", "keep_last=5", "ema=0.9"))
    return out


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])


CORRUPTIONS = {
    "model-truncated": (lambda s: _truncate(next((s / "model").glob("*.safetensors"))), "model"),
    "model-garbled": (lambda s: next((s / "model").glob("*.safetensors")).write_bytes(b"\xff" * 64), "model"),
    "model-missing": (lambda s: __import__("shutil").rmtree(s / "model"), "model"),
    "optim-missing": (lambda s: __import__("shutil").rmtree(s / "optim"), "optim"),
    "optim-metadata-truncated": (lambda s: _truncate(s / "optim" / ".metadata"), "optim"),
    "optim-data-truncated": (lambda s: _truncate(s / "optim" / "__0_0.distcp"), "optim"),
    "trainer-state-truncated": (lambda s: _truncate(s / "trainer_state.json"), "trainer_state.json"),
    "trainer-state-missing-key": (lambda s: (s / "trainer_state.json").write_text('{"step": 4}'),
                                  "trainer_state.json"),
    "rng-truncated": (lambda s: _truncate(s / "rng" / "rank-00000.json"), "rng/rank-00000.json"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, finished_run, case):
    """A truncated or missing checkpoint file was a 50-77 line traceback (DCP's per-rank traceback, safetensors'
    header error, a bare JSONDecodeError) that did not name it: resume and export now say which file."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    step = run / "checkpoints" / "step-000004"
    corrupt, name = CORRUPTIONS[case]
    corrupt(step)
    _cli_fails(capsys, ["train", *BASE_ARGS, "steps=6", "batch_size=8", "save_every=2", "keep_last=5", "ema=0.9",
                        f"out={run}", "resume=true"], str(step / name))
    assert sorted(losses(run)) == [1, 2, 3, 4]                      # nothing trained after the failed load
    if name == "model":
        _cli_fails(capsys, ["export", str(run), str(tmp_path / "export")], str(step / "model"))


def test_the_finite_check_lets_buffers_hold_inf_but_not_nan():
    """A loaded checkpoint is checked for NaN/inf; a module's buffer may hold -inf by design (an additive attention
    mask), so buffers are checked for NaN only (a -inf mask buffer refused every resume and export)."""
    from wamkit.train.checkpoint import first_non_finite

    mask = torch.triu(torch.full((3, 3), float("-inf")), 1)
    sd = {"w": torch.ones(2), "mask": mask, "steps": torch.tensor(3)}
    assert first_non_finite(sd, frozenset({"mask"})) is None
    assert first_non_finite(sd) == "mask"                                   # a weight with inf is corrupt
    assert first_non_finite({**sd, "mask": mask.nan_to_num(nan=0.0).fill_diagonal_(float("nan"))},
                            frozenset({"mask"})) == "mask"
    assert first_non_finite({**sd, "w": torch.tensor([1.0, float("inf")])}, frozenset({"mask"})) == "w"
