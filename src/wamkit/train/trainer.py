"""The SFT loop: one function, readable top to bottom. Parallelism comes from `parallelize.py`, checkpoints from
`checkpoint.py`, data from `data.py`; this file only wires them and runs the steps.

Every rank runs `train(cfg)`. Without torchrun it is a one-rank process group (same code path as N ranks).
Every config / data problem raises UserError before the first step.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from wamkit.core.config import to_dict
from wamkit.core.errors import UserError
from wamkit.policies.base import InitAfterSharding, TrainablePolicy, missing_members
from wamkit.policies.manifest import CHECKPOINT_MANIFEST, PolicyManifest
from wamkit.train import checkpoint as C
from wamkit.train.config import TrainConfig
from wamkit.train.data import BatchStream, DevicePrefetcher, build_source, ensure_action_stats, translate_sampler_state
from wamkit.train.dist import DistInfo, all_gather_object, broadcast_object, close_distributed, init_distributed
from wamkit.train.logger import TrainLogger
from wamkit.train.optim import (EMA, build_optimizer, build_scheduler, check_lr_multipliers, clip_gradients,
                                count_params, lr_factor, select_trainable)
from wamkit.train.parallelize import setup_model


def build_policy(name: str, args: dict, device: str | None = None):
    """A policy by registry name, exported dir, or `package.module:Class` (constructor kwargs = args; the one
    resolver of every verb: wamkit.policies.catalog)."""
    from wamkit.policies import make_policy

    kwargs = dict(args)
    if device is not None:
        kwargs.setdefault("device", device)
    return make_policy(name, **kwargs)


def build_for_training(name: str, args: dict, device: torch.device):
    """(policy, deferred): the policy to train, and whether its weights are still to be initialized after
    `parallelize` (torchtitan's order: build on the meta device, shard, then initialize on each rank's device, so no
    rank ever materializes the whole model). A policy class offers it by implementing `InitAfterSharding`
    (wamkit.policies.base: `can_init_after_sharding(args)`, e.g. false when it loads pretrained weights at
    construction, and `init_weights(device)`); any other policy, an exported directory, or a `policy_args.device` is
    built materialized on the rank's device."""
    from wamkit.policies.registry import is_export_dir, policy_class

    cls = None if is_export_dir(name) else policy_class(name)
    deferred = (isinstance(cls, type) and issubclass(cls, InitAfterSharding) and "device" not in args
                and bool(cls.can_init_after_sharding(args)))
    return build_policy(name, args, device="meta" if deferred else str(device)), deferred


def resolve_io(cfg: TrainConfig, policy) -> tuple[list[str], int]:
    """Cameras and horizon of the run; config values must agree with what the policy consumes / produces."""
    missing = missing_members(policy, TrainablePolicy)     # wamkit.policies.base: what training needs
    if missing or not policy.spec.trainable:
        name = policy.spec.name if hasattr(policy, "spec") else type(policy).__name__
        raise UserError(f"policy {name!r} is not trainable (missing {', '.join(missing) or 'spec.trainable'})")
    spec = policy.spec
    cameras = list(cfg.cameras) or list(spec.input.cameras)
    need = [c for c in spec.input.cameras if c not in cameras]
    if need:
        raise UserError(f"cameras={cameras} lacks camera(s) {need} that policy {spec.name!r} reads")
    horizon = cfg.horizon or spec.action.horizon
    if horizon != spec.action.horizon:
        raise UserError(f"horizon={horizon} but policy {spec.name!r} predicts {spec.action.horizon} actions")
    if cfg.representation and cfg.representation != spec.action.representation:
        raise UserError(f"representation={cfg.representation!r} but policy {spec.name!r} uses "
                        f"{spec.action.representation!r}")
    return cameras, horizon


def check_sample(policy, samples, collate, cameras: list[str], horizon: int) -> None:
    """Collate one sample and check it against what the policy consumes (before anything is trained)."""
    if len(samples) == 0:
        raise UserError("the dataset has no training samples")
    b = collate([samples[0]])
    spec = policy.spec
    missing = [c for c in cameras if c not in b.get("images", {})]
    if missing:
        raise UserError(f"training samples lack camera(s) {missing}; they have {sorted(b.get('images', {}))}")
    if spec.input.state_dim > 0:
        if b.get("state") is None:
            raise UserError(f"policy {spec.name!r} needs a state of {spec.input.state_dim} dims; samples have none")
        if b["state"].shape[-1] != spec.input.state_dim:
            raise UserError(f"policy {spec.name!r} needs a state of {spec.input.state_dim} dims; the dataset's has "
                            f"{b['state'].shape[-1]}")
    a = b["actions"]
    if a.shape[1] != horizon:
        raise UserError(f"training samples have action chunks of {a.shape[1]} steps, the policy predicts {horizon}")


HOST_KEYS = ("state",)   # batch entries that stay on the host (in the loader's pinned memory) unless the policy
                        # names its own (`host_batch_keys`): wam-ref's input processor stacks the states with numpy.
                        # Everything else (images as uint8, actions, masks) is on the device before sft_loss.


def host_keys_of(policy) -> tuple[str, ...]:
    return tuple(getattr(policy, "host_batch_keys", HOST_KEYS))


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# what a run writes in its out= dir, and inside its subdirectories (overwrite=true removes these and nothing else)
RUN_FILES = {"train_log.jsonl": (), "config.json": (), "checkpoints": ("step-*",), "tb": ("events.out.tfevents.*",),
             "wandb": ("run-*", "offline-run-*", "latest-run", "debug*.log")}
TRAIN_CONFIG_KEYS = ("policy", "policy_args", "dataset", "out", "save_every", "keep_last")   # in each run's config


def is_train_config(path: Path) -> bool:
    """Whether `path` is a config.json that `wamkit train` wrote (an eval run's, or any other, is not)."""
    import json

    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and all(k in d for k in TRAIN_CONFIG_KEYS)


def is_run_dir(out: Path) -> bool:
    """A directory `wamkit train` wrote into: its train_log.jsonl, a step-* checkpoint or its config.json."""
    return ((out / "train_log.jsonl").is_file() or bool(C.list_checkpoints(out / "checkpoints"))
            or is_train_config(out / "config.json"))


def check_writable_dir(out: Path) -> None:
    """Create out= and write a file there, before the model and the data are built: an out= that is a file, or on a
    read-only or foreign directory, was found only when the logger opened its file (minutes into a large run), as a
    traceback."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".wamkit-write-test-"):
            pass
    except OSError as e:
        raise UserError(f"out={out} is not a writable directory: {e.strerror or e}"
                        + (f" ({e.filename})" if e.filename and str(e.filename) != str(out) else "")) from None


JOB_LOGS = (".out", ".err", ".log")   # a batch job's own output files, which its scheduler may write into out=


def check_out_dir(cfg: TrainConfig) -> None:
    """A run dir that already holds a run is continued (resume=true) or replaced (overwrite=true), never silently
    mixed with a new run (its log would be appended to, its newest checkpoint exported instead of the new one)."""
    out = Path(cfg.out)
    check_writable_dir(out)
    # a directory of something else: its config.json was overwritten, its tb/ written into (overwrite=true deleted it)
    # (hidden files are not counted: another rank's write test, a .gitkeep; nor a scheduler's job log written there)
    there = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.suffix not in JOB_LOGS)
    if there and not is_run_dir(out):
        shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        raise UserError(f"out={out} holds files that wamkit train did not write ({shown}): choose a new or empty "
                        f"directory (resume=true and overwrite=true take only a training run's directory)")
    ckpts = out / "checkpoints"
    held = (ckpts.is_dir() and any(ckpts.iterdir())) or (out / "train_log.jsonl").exists()
    if held and not (cfg.resume or cfg.overwrite):
        raise UserError(f"{out} already holds a training run; pass resume=true to continue it, overwrite=true to "
                        f"replace it, or choose another out=")
    if cfg.resume and not cfg.overwrite and ckpts.is_dir():
        latest = C.latest_checkpoint(ckpts)
        if latest is not None:
            check_resume_config(cfg, latest)


# what a resumed run must share with the run that wrote its checkpoint: the model the weights load into and what its
# actions mean. The rest may change on resume (steps to extend the schedule, lr, batch size, workers, logging)
RESUME_FIXED = ("policy", "policy_args", "cameras", "horizon", "representation", "trainable")
RESUME_WARNED = "WAMKIT_RESUME_WARNED"   # set by `wamkit train nproc=N` for its ranks: it printed the warnings


def check_resume_config(cfg: TrainConfig, ckpt: Path) -> None:
    """resume=true into a run whose checkpoint was written with another model: a one-line error naming the keys
    (found as a size-mismatch or missing-key traceback after the model was built, or not at all); another dataset:
    a warning (a moved dataset is the same data; other data re-normalizes the actions mid-run); a schedule that
    ends at or before the checkpoint: a warning (nothing is trained)."""
    import json

    saved = C.read_json_file(ckpt / "config.json")   # missing or corrupt: one line (the check was skipped)
    now = json.loads(C._json(to_dict(cfg)))
    diff = [k for k in RESUME_FIXED if k in saved and saved[k] != now.get(k)]
    if C._trained_with_ema(ckpt) != (cfg.ema > 0):   # EMA dropped (export took the raw weights) or none to load
        diff.append("ema")
    if diff:
        was = ", ".join(f"{k}={json.dumps(saved.get(k))}" for k in diff)
        asked = ", ".join(f"{k}={json.dumps(now.get(k))}" for k in diff)
        raise UserError(f"resume=true: {ckpt} was trained with {was}, this run asks for {asked}; resume with the "
                        f"checkpoint's values, or start a new run (overwrite=true or another out=)")
    if os.environ.get("RANK", "0") != "0" or os.environ.get(RESUME_WARNED):   # under torchrun: said by the
        return                                                                  # launcher, or by rank 0
    if saved.get("dataset") and saved.get("dataset") != now.get("dataset"):
        print(f"wamkit train: warning: resuming {ckpt} (trained on dataset={saved['dataset']}) on "
              f"dataset={now.get('dataset')}: the action statistics are computed again from it", flush=True)
    m = C.STEP_RE.match(ckpt.name)
    step = int(m.group(1)) if m else None
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    if step is not None and step >= end:
        print(f"wamkit train: warning: {ckpt} is at step {step}, at or past this run's last step ({end}): nothing "
              f"to train (raise steps= to continue the schedule)", flush=True)
    if cfg.logger == "wandb":
        from wamkit.core.tracking import require_wandb

        require_wandb()


def clear_out_dir(out: Path) -> None:
    """overwrite=true: remove what a previous run wrote (RUN_FILES: its log, its config.json, its step-* checkpoints,
    TensorBoard event files and W&B runs; a subdirectory left empty too) and nothing else: a user's file in tb/ or
    checkpoints/ stays (all of tb/ was deleted)."""
    import shutil

    for name, inside in RUN_FILES.items():
        p = out / name
        if not inside:
            if p.is_file() and (name != "config.json" or is_train_config(p)):
                p.unlink()
            continue
        if not p.is_dir() or p.is_symlink():
            continue
        for pattern in inside:
            for q in p.glob(pattern):
                if q.is_dir() and not q.is_symlink():
                    shutil.rmtree(q)
                else:
                    q.unlink()
        if not any(p.iterdir()):
            p.rmdir()


def train(cfg: TrainConfig, out_checked: bool = False) -> dict:
    """Run (or continue) training; returns a summary dict (rank 0's view). out_checked: the caller ran
    check_out_dir (its warnings are not printed twice)."""
    if not out_checked:
        check_out_dir(cfg)
    info = init_distributed(cfg.device)
    gc_on = gc.isenabled()
    try:
        return _train(cfg, info)
    finally:
        if gc_on:
            gc.enable()   # gc_every turns automatic collection off for the loop
        close_distributed(info)


def _train(cfg: TrainConfig, info: DistInfo) -> dict:
    out = Path(cfg.out)
    ckpt_root = out / "checkpoints"
    rank, world = info.rank, info.world_size
    if cfg.overwrite:
        if info.is_main:
            clear_out_dir(out)
        _ = all_gather_object(None)   # cleared before any rank writes

    # ---- batch geometry
    per_step = world * cfg.grad_accum
    if cfg.batch_size % per_step:
        raise UserError(f"batch_size={cfg.batch_size} is not divisible by ranks x grad_accum = {world} x "
                        f"{cfg.grad_accum}")
    micro = cfg.batch_size // per_step

    # ---- policy (same init on every rank; large ones on the meta device until sharded), trainable set, lr groups:
    # all checked before any data is read
    C.seed_everything(cfg.seed)
    policy, deferred_init = build_for_training(cfg.policy, cfg.policy_args, info.device)
    cameras, horizon = resolve_io(cfg, policy)
    module = policy.module
    patterns = list(cfg.trainable) or list(getattr(policy, "trainable_patterns", None) or [])
    select_trainable(module, patterns)
    multipliers = dict(cfg.lr_multipliers) or dict(policy.lr_multipliers())
    check_lr_multipliers(module, multipliers)

    # ---- data: source (fps / features checked), normalizer stats (rank 0 computes, all receive), sampler
    source = build_source(cfg, policy, cameras, horizon)
    pipe_stats = None
    if rank == 0:
        pipe, stats = ensure_action_stats(policy, source, horizon, cfg.seed)
        pipe_stats = (pipe.to_dict(), stats)
    pipe_dict, stats = broadcast_object(pipe_stats)
    from wamkit.data.transforms import ActionPipeline

    policy.action_pipeline = ActionPipeline.from_dict(pipe_dict)
    samples = source.make_samples(policy.action_pipeline)
    check_sample(policy, samples, source.collate, cameras, horizon)
    sampler = source.make_sampler(len(samples), rank=rank, world_size=world, seed=cfg.seed)

    # ---- numerics + parallelism (parallelize.setup_model): fp32 master weights; shard=fsdp: AC -> compile ->
    # fully_shard(units) -> fully_shard(root), then (meta-built policies) each rank initializes its shards: the same
    # weights as a materialized build; shard=none (auto on one rank): AC -> compile -> init, no fully_shard, and with
    # bf16 the module computes on bf16 copies of the fp32 masters the optimizer updates (train/master.py)
    module.float()
    module.train()
    model = setup_model(module, list(policy.fsdp_units()), info.device.type, world, shard=cfg.shard,
                        mixed_precision=cfg.mixed_precision, activation_checkpointing=cfg.activation_checkpointing,
                        compile=cfg.compile, reshard_after_forward=cfg.reshard_after_forward,
                        cast_root_inputs=cfg.cast_root_inputs,
                        init=(lambda: policy.init_weights(info.device)) if deferred_init else None)
    state_module = model.state   # what the optimizer, the EMA and checkpoints see (names of `module`)
    optimizer = build_optimizer(state_module, cfg, multipliers, master=model.master)
    scheduler = build_scheduler(optimizer, cfg)
    ema = EMA(state_module, cfg.ema) if cfg.ema > 0 else None
    trainable = [p for p in state_module.parameters() if p.requires_grad]

    # ---- resume
    start, samples_seen, resumed_from = 0, 0, None
    C.seed_everything(C.rank_seed(cfg.seed, rank))
    if cfg.resume:
        path = C.latest_checkpoint(ckpt_root)
        if path is not None:
            r = C.load_checkpoint(path, model=state_module, optimizer=optimizer, scheduler=scheduler, ema=ema,
                                  rank=rank, world_size=world, seed=cfg.seed, trust=cfg.trust_checkpoint)
            model.after_load()
            sstate = r.sampler_state
            if r.world_size_changed:
                sstate, warn = translate_sampler_state(sstate, world, rank)
                if warn and info.is_main:
                    print(f"wamkit train: warning: {warn}", flush=True)
            sampler.load_state_dict(sstate)
            start, samples_seen, resumed_from = r.step, r.samples_seen, str(path)
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    stream = BatchStream(samples, sampler, source.collate, micro, cfg.num_workers,
                         seed=C.rank_seed(cfg.seed, rank, start), pin_memory=info.device.type == "cuda")
    # on the device one batch ahead; the loader's thread work off the loop's thread on CUDA (with worker processes:
    # with num_workers=0 the dataset itself would run in that thread, beside the loop's use of the global RNGs)
    batches = DevicePrefetcher(lambda: (stream.next(), stream.state), info.device, host_keys_of(policy),
                               thread=info.device.type == "cuda" and cfg.num_workers > 0,
                               initial_state=stream.state)
    try:
        return _loop(cfg, info, policy, model, optimizer, scheduler, ema, trainable, batches, start, end,
                     samples_seen, resumed_from, out, ckpt_root, stats, micro)
    finally:
        batches.close()
        stream.close()


def _first_non_finite(dev_window: dict[str, list[torch.Tensor]], first_step: int, ga: int) -> tuple[str, int] | None:
    """(what, step) of the first step of a window whose loss or grad norm is NaN/inf on this rank, or None. Read only
    once a window is known to be bad (or before a checkpoint, which syncs anyway): no extra host sync per step."""
    found: list[tuple[int, str]] = []
    for name, per in (("loss", ga), ("grad_norm", 1)):
        vals = dev_window.get(name)
        if not vals:
            continue
        ok = torch.isfinite(torch.stack(vals).float().view(-1, per)).all(dim=1).cpu()
        bad = torch.nonzero(~ok).flatten()
        if bad.numel():
            found.append((first_step + int(bad[0]), name))
    if not found:
        return None
    step = min(found)[0]
    return " and ".join(n for st, n in sorted(found, key=lambda f: f[1] != "loss") if st == step), step


def _check_finite_window(dev_window: dict[str, list[torch.Tensor]], first_step: int, last_step: int, ga: int,
                         bad: bool, ckpt_root: Path, log: TrainLogger) -> None:
    """UserError when any rank's loss or grad norm of steps first_step..last_step was NaN/inf (all ranks call it with
    the same verdict, `bad` reduced over ranks by the caller, so they stop together): a NaN step makes every later
    weight NaN, and training on to a NaN checkpoint, exit 0, was what the user got before."""
    if not bad:
        return
    log.close()
    first = _first_non_finite(dev_window, first_step, ga)
    what, at = first if first else ("loss or grad_norm", first_step)
    newest = C.latest_checkpoint(ckpt_root)
    raise UserError(f"non-finite {what} (NaN/inf) at step {at} (steps {first_step}..{last_step} checked): NaN/inf in "
                    f"the data, or a learning rate too high; training stopped, the newest checkpoint is "
                    f"{newest or 'none'} (none is written from a non-finite step)")


class StopOnSigterm:
    """One rank: SIGTERM (a scheduler's preemption, `timeout`, `kill`) ends the run after the step under way, with a
    checkpoint, so resume=true loses nothing; it ended the process at once, losing up to save_every steps. A second
    SIGTERM ends it at once. Under torchrun (several ranks) nothing is installed: the ranks would have to agree on a
    step, and torchrun kills them 30 s after it forwards the signal; they resume from their last checkpoint."""

    def __init__(self, enabled: bool):
        self.requested = False
        self._old = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def close(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


def _loop(cfg: TrainConfig, info: DistInfo, policy, model, optimizer, scheduler, ema, trainable, batches, start: int,
          end: int, samples_seen: int, resumed_from, out: Path, ckpt_root: Path, stats, micro: int) -> dict:
    rank, world = info.rank, info.world_size
    module, state_module, precision = model.module, model.state, model.precision

    total_p, train_p = count_params(module)
    log = TrainLogger(out, enabled=info.is_main, total_steps=cfg.steps, start_step=start, progress=cfg.progress,
                      wandb_project=cfg.wandb_project if cfg.logger == "wandb" else None, config=to_dict(cfg))
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(C._json(to_dict(cfg)))
        log.text(f"wamkit train: {cfg.policy} | {total_p / 1e6:.2f}M params ({train_p / 1e6:.2f}M trainable) | "
                 f"{world} rank(s) on {info.device.type} | shard={model.shard} | {precision} | global batch "
                 f"{cfg.batch_size} = {world} x {cfg.grad_accum} x {micro} | steps {start}->{end}"
                 + (f" | resumed from {resumed_from}" if resumed_from else ""))
    manifest = PolicyManifest(policy=cfg.policy, config=cfg.policy_args, spec=policy.spec.to_dict(),
                              files={"action_pipeline": "action_pipeline.json"})
    meta = {"config.json": to_dict(cfg), CHECKPOINT_MANIFEST: manifest.to_dict(),
            "action_pipeline.json": policy.action_pipeline.to_dict()}
    if stats is not None:
        meta["action_stats.json"] = stats

    def save(step: int) -> Path:
        return C.save_checkpoint(ckpt_root, step, model=state_module, optimizer=optimizer, scheduler=scheduler,
                                 ema=ema, sampler_state=batches.state, samples_seen=samples_seen, meta=meta, rank=rank,
                                 world_size=world, keep_last=cfg.keep_last)

    # ---- the loop. The trainer itself reads nothing back from the device between log windows: the loss, the grad
    # norm and a policy's tensor metrics are kept as device tensors and read once per window, in one transfer (a
    # policy's float metrics are its own host reads). data_wait_s: time the loop blocked on the data (~0 when the
    # prefetcher keeps ahead). Per micro-step the loop's own host work is the prefetcher handoff, the policy's
    # sft_loss, backward and, for shard=none + bf16, one multi-tensor copy of the gradients to the fp32 masters.
    window: dict[str, float] = {}
    dev_window: dict[str, list[torch.Tensor]] = {}
    window_steps, t_window, data_wait = 0, time.perf_counter(), 0.0
    last: dict[str, float] = {}
    retries0 = _alloc_retries(info.device)
    ga = cfg.grad_accum
    clip = cfg.grad_clip or math.inf
    if cfg.gc_every:
        gc.collect()
        gc.disable()
    stop = StopOnSigterm(world == 1)
    stopped = None

    try:
        for step in range(start, end):
            for k in range(ga):
                t_data = time.perf_counter()
                batch = batches.next()
                data_wait += time.perf_counter() - t_data
                model.before_backward(k == ga - 1)     # FSDP2: reduce-scatter only on the last micro-step
                loss, metrics = policy.sft_loss(batch)
                scaled = loss / ga if ga > 1 else loss
                scaled.backward()
                model.after_backward(k == 0, k == ga - 1)   # shard=none + bf16: bf16 grads -> fp32 master grads
                dev_window.setdefault("loss", []).append(scaled.detach())
                for name, v in metrics.items():
                    if name == "loss":
                        continue
                    if torch.is_tensor(v):
                        dev_window.setdefault(name, []).append(v.detach() / ga if ga > 1 else v.detach())
                    else:
                        window[name] = window.get(name, 0.0) + float(v) / ga
            grad_norm = _full(clip_gradients(optimizer, trainable, clip))
            dev_window.setdefault("grad_norm", []).append(grad_norm.detach())
            optimizer.step()
            scheduler.step()
            model.after_optimizer_step(optimizer)     # masters -> bf16 weights (shard=none), or zero_grad
            if ema is not None:
                ema.update()
            samples_seen += cfg.batch_size
            window_steps += 1
            done = step + 1
            if cfg.gc_every and done % cfg.gc_every == 0:
                gc.collect(1)

            if stop.requested:
                stopped = "SIGTERM"                # this step is the last: logged and checkpointed below
            if done % cfg.log_every == 0 or done == end or stopped:
                if dev_window:                          # the window's one device read
                    names = list(dev_window)
                    sums = torch.stack([torch.stack(dev_window[n]).float().sum().to(info.device)
                                        for n in names]).tolist()
                    for name, v in zip(names, sums):
                        window[name] = window.get(name, 0.0) + v
                window["data_wait_s"] = data_wait
                keys = sorted(window)
                vec = torch.tensor([window[k] for k in keys], dtype=torch.float64)
                dist.all_reduce(vec)                    # mean over ranks (grad_norm is global: same on every rank)
                dt = time.perf_counter() - t_window
                last = {k: float(v) / window_steps / world for k, v in zip(keys, vec)}
                last.update(lr=cfg.lr * lr_factor(step, cfg.warmup, cfg.decay, cfg.steps),
                            samples_per_s=cfg.batch_size * window_steps / dt, steps_per_s=window_steps / dt,
                            step_s=dt / window_steps, samples_seen=samples_seen)
                if info.device.type == "cuda":           # allocator retries (cudaFree + retry: fragmentation) so far
                    last["alloc_retries"] = float(_alloc_retries(info.device) - retries0)
                # the sums were reduced over ranks: a NaN/inf on any rank is in every rank's `last`
                bad = not all(math.isfinite(last.get(k, 0.0)) for k in ("loss", "grad_norm"))
                _check_finite_window(dev_window, done - window_steps + 1, done, ga, bad, ckpt_root, log)
                log.log(done, last)
                window, dev_window, window_steps, t_window, data_wait = {}, {}, 0, time.perf_counter(), 0.0
            if (cfg.save_every and done % cfg.save_every == 0) or done == end or stopped:
                if window_steps:   # steps since the last log window: checked here, so no checkpoint holds NaN weights
                    flag = torch.tensor([0.0 if _first_non_finite(dev_window, 0, ga) is None else 1.0],
                                        dtype=torch.float64)
                    dist.all_reduce(flag)
                    _check_finite_window(dev_window, done - window_steps + 1, done, ga, bool(flag.item()), ckpt_root,
                                         log)
                save(done)
            if stopped:
                log.text(f"wamkit train: {stopped} at step {done}: checkpoint written, stopping (resume=true "
                         f"continues)")
                end = done
                break
    finally:
        stop.close()

    log.close()
    summary = {"steps": end, "start": start, "world_size": world, "last": last,
               "checkpoint": str(C.latest_checkpoint(ckpt_root)), "params": total_p, "trainable_params": train_p,
               "stopped": stopped}
    _ = all_gather_object(None)   # everyone finished writing before rank 0 returns
    return summary
