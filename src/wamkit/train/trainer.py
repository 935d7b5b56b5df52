"""The SFT loop: one function, readable top to bottom. Parallelism comes from `parallelize.py`, checkpoints from
`checkpoint.py`, data from `data.py`; this file only wires them and runs the steps.

Every rank runs `train(cfg)`. Without torchrun it is a one-rank process group (same code path as N ranks).
Every config / data problem raises UserError before the first step.
"""

from __future__ import annotations

import gc
import math
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
from wamkit.train.data import (BatchStream, build_source, ensure_action_stats, import_target, is_import_target,
                               translate_sampler_state)
from wamkit.train.dist import DistInfo, all_gather_object, broadcast_object, close_distributed, init_distributed
from wamkit.train.logger import TrainLogger
from wamkit.train.optim import (EMA, build_optimizer, build_scheduler, check_lr_multipliers, count_params,
                                lr_factor, select_trainable)
from wamkit.train.parallelize import parallelize, resolved_precision


def build_policy(name: str, args: dict, device: str | None = None):
    """A policy by registry name, exported dir, or `package.module:Class` (constructor kwargs = args)."""
    kwargs = dict(args)
    if device is not None:
        kwargs.setdefault("device", device)
    if is_import_target(name):
        return import_target(name)(**kwargs)
    from wamkit.policies import make_policy

    return make_policy(name, **kwargs)


def build_for_training(name: str, args: dict, device: torch.device):
    """(policy, deferred): the policy to train, and whether its weights are still to be initialized after
    `parallelize` (torchtitan's order: build on the meta device, shard, then initialize on each rank's device, so no
    rank ever materializes the whole model). A policy class offers it by implementing `InitAfterSharding`
    (wamkit.policies.base: `can_init_after_sharding(args)`, e.g. false when it loads pretrained weights at
    construction, and `init_weights(device)`); any other policy, an exported directory, or a `policy_args.device` is
    built materialized on the rank's device."""
    from wamkit.policies.registry import is_export_dir, policy_class

    cls = None
    if is_import_target(name):
        cls = import_target(name)
    elif not is_export_dir(name):
        cls = policy_class(name)
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


HOST_KEYS = ("images",)   # batch entries the policy reads on the host (wam-ref uploads uint8 images and converts them
                          # on its device); they stay in the loader's pinned memory


def _to_device(x, device: torch.device):
    """A collated batch onto `device`: tensors copied non_blocking (from the loader's pinned memory the copy
    overlaps the previous step's work), HOST_KEYS left where they are."""
    if torch.is_tensor(x):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: (v if k in HOST_KEYS else _to_device(v, device)) for k, v in x.items()}
    return x


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


RUN_FILES = ("checkpoints", "train_log.jsonl", "tb", "config.json", "wandb")


def check_out_dir(cfg: TrainConfig) -> None:
    """A run dir that already holds a run is continued (resume=true) or replaced (overwrite=true), never silently
    mixed with a new run (its log would be appended to, its newest checkpoint exported instead of the new one)."""
    out = Path(cfg.out)
    ckpts = out / "checkpoints"
    held = (ckpts.is_dir() and any(ckpts.iterdir())) or (out / "train_log.jsonl").exists()
    if held and not (cfg.resume or cfg.overwrite):
        raise UserError(f"{out} already holds a training run; pass resume=true to continue it, overwrite=true to "
                        f"replace it, or choose another out=")
    if cfg.logger == "wandb":
        from wamkit.core.tracking import require_wandb

        require_wandb()


def clear_out_dir(out: Path) -> None:
    """overwrite=true: remove what a previous run wrote (only wamkit's own files; anything else stays)."""
    import shutil

    for name in RUN_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def train(cfg: TrainConfig) -> dict:
    """Run (or continue) training; returns a summary dict (rank 0's view)."""
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

    # ---- numerics + parallelism: fp32 master weights, then AC -> compile -> fully_shard(units) -> fully_shard(root),
    # then (meta-built policies) each rank initializes its shards: the same weights as a materialized build
    module.float()
    module.train()
    precision = resolved_precision(cfg.mixed_precision, info.device.type)
    parallelize(module, list(policy.fsdp_units()), info.device.type, world, mixed_precision=cfg.mixed_precision,
                activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                reshard_after_forward=cfg.reshard_after_forward, cast_root_inputs=cfg.cast_root_inputs)
    if deferred_init:
        policy.init_weights(info.device)
    optimizer = build_optimizer(module, cfg, multipliers)
    scheduler = build_scheduler(optimizer, cfg)
    ema = EMA(module, cfg.ema) if cfg.ema > 0 else None
    trainable = [p for p in module.parameters() if p.requires_grad]

    # ---- resume
    start, samples_seen, resumed_from = 0, 0, None
    C.seed_everything(C.rank_seed(cfg.seed, rank))
    if cfg.resume:
        path = C.latest_checkpoint(ckpt_root)
        if path is not None:
            r = C.load_checkpoint(path, model=module, optimizer=optimizer, scheduler=scheduler, ema=ema, rank=rank,
                                  world_size=world, seed=cfg.seed, trust=cfg.trust_checkpoint)
            sstate = r.sampler_state
            if r.world_size_changed:
                sstate, warn = translate_sampler_state(sstate, world, rank)
                if warn and info.is_main:
                    print(f"wamkit train: warning: {warn}", flush=True)
            sampler.load_state_dict(sstate)
            start, samples_seen, resumed_from = r.step, r.samples_seen, str(path)
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    batches = BatchStream(samples, sampler, source.collate, micro, cfg.num_workers,
                          seed=C.rank_seed(cfg.seed, rank, start), pin_memory=info.device.type == "cuda")

    total_p, train_p = count_params(module)
    log = TrainLogger(out, enabled=info.is_main, total_steps=cfg.steps, start_step=start, progress=cfg.progress,
                      wandb_project=cfg.wandb_project if cfg.logger == "wandb" else None, config=to_dict(cfg))
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(C._json(to_dict(cfg)))
        log.text(f"wamkit train: {cfg.policy} | {total_p / 1e6:.2f}M params ({train_p / 1e6:.2f}M trainable) | "
                 f"{world} rank(s) on {info.device.type} | {precision} | global batch {cfg.batch_size} = {world} x "
                 f"{cfg.grad_accum} x {micro} | steps {start}->{end}"
                 + (f" | resumed from {resumed_from}" if resumed_from else ""))
    manifest = PolicyManifest(policy=cfg.policy, config=cfg.policy_args, spec=policy.spec.to_dict(),
                              files={"action_pipeline": "action_pipeline.json"})
    meta = {"config.json": to_dict(cfg), CHECKPOINT_MANIFEST: manifest.to_dict(),
            "action_pipeline.json": policy.action_pipeline.to_dict()}
    if stats is not None:
        meta["action_stats.json"] = stats

    def save(step: int) -> Path:
        return C.save_checkpoint(ckpt_root, step, model=module, optimizer=optimizer, scheduler=scheduler, ema=ema,
                                 sampler_state=batches.state, samples_seen=samples_seen, meta=meta, rank=rank,
                                 world_size=world, keep_last=cfg.keep_last)

    # ---- the loop. The trainer itself reads nothing back from the device between log windows: the loss and the
    # grad norm are summed on the device (a policy's float metrics are its own host reads). data_wait_s: time the
    # loop blocked on the data loader (prefetching workers, pinned memory, non_blocking copies: ~0 when it keeps up)
    window: dict[str, float] = {}
    dev_window: dict[str, torch.Tensor] = {}
    window_steps, t_window, data_wait = 0, time.perf_counter(), 0.0
    last: dict[str, float] = {}
    retries0 = _alloc_retries(info.device)
    if cfg.gc_every:
        gc.collect()
        gc.disable()

    def add_dev(name: str, v: torch.Tensor) -> None:
        v = v.detach().float()
        dev_window[name] = v if name not in dev_window else dev_window[name] + v

    for step in range(start, end):
        for k in range(cfg.grad_accum):
            t_data = time.perf_counter()
            batch = _to_device(batches.next(), info.device)
            data_wait += time.perf_counter() - t_data
            module.set_requires_gradient_sync(k == cfg.grad_accum - 1)   # reduce-scatter only on the last micro-step
            loss, metrics = policy.sft_loss(batch)
            (loss / cfg.grad_accum).backward()
            add_dev("loss", loss / cfg.grad_accum)
            for name, v in metrics.items():
                if name == "loss":
                    continue
                if torch.is_tensor(v):
                    add_dev(name, v / cfg.grad_accum)
                else:
                    window[name] = window.get(name, 0.0) + float(v) / cfg.grad_accum
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip or math.inf, foreach=True))
        add_dev("grad_norm", grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()
        samples_seen += cfg.batch_size
        window_steps += 1
        done = step + 1
        if cfg.gc_every and done % cfg.gc_every == 0:
            gc.collect(1)

        if done % cfg.log_every == 0 or done == end:
            for name, v in dev_window.items():     # the window's one device read
                window[name] = window.get(name, 0.0) + float(v)
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
            log.log(done, last)
            window, dev_window, window_steps, t_window, data_wait = {}, {}, 0, time.perf_counter(), 0.0
        if (cfg.save_every and done % cfg.save_every == 0) or done == end:
            save(done)

    log.close()
    summary = {"steps": end, "start": start, "world_size": world, "last": last,
               "checkpoint": str(C.latest_checkpoint(ckpt_root)), "params": total_p, "trainable_params": train_p}
    _ = all_gather_object(None)   # everyone finished writing before rank 0 returns
    return summary
