"""Which parameters train, their AdamW groups, the LR schedule and the EMA of weights.

Patterns are shell globs (`fnmatch`) over parameter names as `module.named_parameters()` gives them
(e.g. `action_in.*`, `blocks.*.mlp.*`). A pattern that matches no parameter is a UserError (a typo would otherwise
silently freeze or slow down part of the model).
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn as nn

from wamkit.core.errors import UserError


def _unmatched(patterns, names) -> list[str]:
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def _sample_names(names: list[str], k: int = 8) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def select_trainable(module: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad from `patterns` ([] = every parameter trains). Returns the trainable names."""
    names = [n for n, _ in module.named_parameters()]
    if patterns:
        bad = _unmatched(patterns, names)
        if bad:
            raise UserError(f"trainable pattern(s) {bad} match no parameter; parameters are: {_sample_names(names)}")
    out = []
    for n, p in module.named_parameters():
        on = (not patterns) or any(fnmatch.fnmatchcase(n, pat) for pat in patterns)
        p.requires_grad_(on)
        if on:
            out.append(n)
    if not out:
        raise UserError("no trainable parameters")
    return out


def check_lr_multipliers(module: nn.Module, multipliers: dict) -> None:
    names = [n for n, _ in module.named_parameters()]
    bad = _unmatched(list(multipliers), names)
    if bad:
        raise UserError(f"lr_multipliers pattern(s) {bad} match no parameter; parameters are: {_sample_names(names)}")


def param_groups(module: nn.Module, multipliers: dict, weight_decay: float) -> list[dict]:
    """AdamW groups keyed by (lr multiplier, weight decay). The first matching multiplier pattern wins (in the
    order given); weight decay only on >= 2-D parameters. Each group records `lr_mult` for the scheduler."""
    groups: dict[tuple[float, float], dict] = {}
    for n, p in module.named_parameters():
        if not p.requires_grad:
            continue
        mult = 1.0
        for pat, m in multipliers.items():
            if fnmatch.fnmatchcase(n, pat):
                mult = float(m)
                break
        wd = weight_decay if p.ndim >= 2 else 0.0
        g = groups.setdefault((mult, wd), {"params": [], "names": [], "lr_mult": mult, "weight_decay": wd})
        g["params"].append(p)
        g["names"].append(n)
    return [{k: v for k, v in g.items() if k != "names"} for _, g in sorted(groups.items())]


def build_optimizer(module: nn.Module, cfg, multipliers: dict, master=None) -> torch.optim.Optimizer:
    """AdamW over `module`'s trainable parameters. optimizer_impl: fused (one kernel per parameter group on GPUs) or
    foreach (multi-tensor), both of which work on DTensor (FSDP2) parameters; triton: MasterAdamW
    (train/master_adamw.py), shard=none + bf16 only (`master`: the MasterWeights whose fp32 masters `module` holds):
    the copy of the gradients to fp32, the clip, the update and the copy back to bf16 in one pass per tensor.
    auto: fused on CUDA, foreach elsewhere."""
    groups = param_groups(module, multipliers, cfg.weight_decay)
    for g in groups:
        g["lr"] = cfg.lr * g["lr_mult"]
    impl = getattr(cfg, "optimizer_impl", "auto")
    if impl == "auto":
        on_cuda = any(p.device.type == "cuda" for g in groups for p in g["params"])
        impl = "fused" if on_cuda else "foreach"
    if impl == "triton":
        if master is None:
            raise UserError("optimizer_impl=triton steps the fp32 master weights of shard=none with bf16 mixed "
                            "precision; this run has none (shard=fsdp, or fp32): use auto, fused or foreach")
        from wamkit.train.master_adamw import MasterAdamW

        return MasterAdamW(groups, master, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kw)


def clip_gradients(optimizer: torch.optim.Optimizer, params: list, max_norm: float) -> torch.Tensor:
    """The gradients' total 2-norm, clipped to max_norm (math.inf: measured only). An optimizer with a clip of its
    own (MasterAdamW: it reads gradients torch's clip cannot see, and applies the coefficient inside its step) does
    it; otherwise torch.nn.utils.clip_grad_norm_ over `params`."""
    own = getattr(optimizer, "clip_grad_norm_", None)
    if own is not None:
        return own(max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def lr_factor(step: int, warmup: int, decay: int | None, total: int) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based): linear warmup over `warmup` steps
    ((step+1)/warmup), then linear decay to 0 over `decay` steps (None = until `total`; 0 = constant)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if decay is None:
        decay = max(total - warmup, 0)
    if decay == 0:
        return 1.0
    return max(0.0, 1.0 - (step - warmup) / decay)


def build_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup, cfg.decay, cfg.steps))


# what a run's config sets in each AdamW group, as opposed to what training accumulates (moments, step counts)
HYPERPARAMETERS = ("initial_lr", "weight_decay", "betas", "eps")


def this_runs_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's hyperparameters as this run's config built them (before a checkpoint's state is loaded)."""
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, fresh: list[dict]) -> None:
    """After a resume loaded the optimizer's groups and the scheduler's base lrs from a checkpoint: put back this
    run's lr, weight decay, betas and eps (a resume may change them, docs/training.md), and set each group's lr to
    its new base at the scheduler's step, so the lr that runs is the lr that is logged."""
    for g, f in zip(optimizer.param_groups, fresh):
        g.update(f)
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for g, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        g["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


class EMA:
    """Exponential moving average of the trainable weights, kept in fp32 with the same (sharded) layout as the
    parameters: each rank averages its own shard, no communication. `decay` 0.999 ~ a 1000-step window."""

    def __init__(self, module: nn.Module, decay: float):
        self.decay = float(decay)
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        params = dict(module.named_parameters())
        self.shadow = {n: params[n].detach().clone().float() for n in self.names}
        self._params = [params[n] for n in self.names]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(list(self.shadow.values()), [p.detach() for p in self._params], 1.0 - self.decay)

    def state_dict(self) -> dict:
        return dict(self.shadow)

    def load_state_dict(self, sd: dict) -> None:
        for n in self.names:
            self.shadow[n].copy_(sd[n])


def count_params(module: nn.Module) -> tuple[int, int]:
    tot = train = 0
    for p in module.parameters():
        k = math.prod(p.shape)
        tot += k
        train += k if p.requires_grad else 0
    return tot, train
