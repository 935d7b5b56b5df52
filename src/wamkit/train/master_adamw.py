"""AdamW on the fp32 masters of shard=none + bf16 (train/master.py) in one pass per tensor: `optimizer_impl=triton`.

The default path of one optimizer step touches every weight's bytes five times (profiled on the H200, wam-ref 1b,
batch 64: 58.7 ms of a 336 ms step, of which torch's fused AdamW itself is 20.5 ms):

    grads_to_master   bf16 grads -> fp32 master grads (a copy)
    clip_grad_norm_   the norm of the fp32 grads, then every grad multiplied by the clip coefficient
    AdamW (fused)     fp32 master, exp_avg, exp_avg_sq updated from the fp32 grad
    masters_to_model  fp32 masters -> the module's bf16 weights (a copy)

Here the module's bf16 gradient stays where backward put it; the clip norm is taken over those bf16 gradients
(accumulated in fp32); and one Triton kernel per tensor reads the bf16 gradient, scales it by the clip coefficient
(a device scalar: no host sync), updates master, exp_avg and exp_avg_sq exactly as torch's fused AdamW does, and
writes the rounded bf16 weight: 14 bytes read and 14 written per weight, against ~40 moved by the four passes.

Everything else is torch.optim.AdamW's: parameter groups (the masters), `state` (`step`, `exp_avg`, `exp_avg_sq`,
so checkpoints load into either implementation), `state_dict`, the LR scheduler. With gradient accumulation (more
than one micro-step per optimizer step) the gradients are summed in fp32 on the masters as before, and the kernel
reads those. Without a usable kernel (no Triton, or CPU tensors outside TRITON_INTERPRET=1) the same arithmetic
runs as torch ops, so results do not depend on where it runs beyond rounding.
"""

from __future__ import annotations

import math
import os

import torch

try:   # Triton ships with CUDA builds of torch, not with CPU ones
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "no kernel"
    triton = tl = None

BLOCK = 2048


def kernel_usable(device: torch.device) -> bool:
    """Whether the Triton kernel runs for tensors on `device` (CUDA, or anywhere under TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _master_adamw_kernel(g_ptr, w_ptr, m_ptr, v_ptr, p_ptr, coef_ptr, n, beta1, beta2, eps, decay, step_size,
                             bc2_sqrt, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        coef = tl.load(coef_ptr)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * coef
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        w = w * decay                                        # decoupled weight decay: w -= lr * wd * w
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        w = w - step_size * m / denom
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(w_ptr + offs, w, mask=mask)
        # the bf16 weight, rounded to nearest even in integer arithmetic (what the GPU's conversion does; Triton's
        # CPU interpreter truncates instead, so this keeps the two equal, and equal to torch's .to(bfloat16))
        bits = w.to(tl.uint32, bitcast=True)
        rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        nan = ((bits >> 16) | 0x0040).to(tl.uint16)          # a NaN stays a (quiet) NaN
        half = tl.where(w != w, nan, rne)
        tl.store(p_ptr + offs, half.to(tl.bfloat16, bitcast=True), mask=mask)


@torch.no_grad()
def _step_torch(g, w, m, v, p, coef, beta1, beta2, eps, decay, step_size, bc2_sqrt) -> None:
    """The kernel's arithmetic as torch ops (no usable kernel)."""
    g = g.float() * coef
    w.mul_(decay)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    w.addcdiv_(m, denom, value=-step_size)
    p.copy_(w)


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over the fp32 masters of `master` (a MasterWeights), stepped by `_master_adamw_kernel`.

    `pairs` maps each master to the module parameter it feeds (bf16): its gradient is read from there and its new
    value written there. Call `clip_grad_norm_(max_norm)` before `step()` (its coefficient is applied inside the
    step; without it the coefficient is 1)."""

    writes_model = True   # the step writes the module's bf16 weights and clears the gradients (TrainModel)

    def __init__(self, groups, master, lr: float, betas, eps: float):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, foreach=False)
        self.master = master
        master.grads_stay = True
        self._compute = {id(m): p for p, m in master.trainable_pairs()}
        self._coef: torch.Tensor | None = None
        self._ones: dict[torch.device, torch.Tensor] = {}

    def _grad_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step uses: the masters' fp32 sum over micro-steps, or the module's bf16 one."""
        if master.grad is not None:
            return master.grad
        p = self._compute.get(id(master))
        return None if p is None else p.grad

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The total 2-norm of the gradients the step will use, as torch.nn.utils.clip_grad_norm_ computes it, and
        the clip coefficient min(1, max_norm / (norm + 1e-6)) kept on the device for the step."""
        grads = [g for group in self.param_groups for m in group["params"] if (g := self._grad_of(m)) is not None]
        if not grads:
            self._coef = None
            return torch.zeros(())
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        self._coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def _one(self, device: torch.device) -> torch.Tensor:
        t = self._ones.get(device)
        if t is None:
            t = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return t

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW does not take a closure")
        coef, self._coef = self._coef, None
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("MasterAdamW implements plain AdamW (no amsgrad, no maximize)")
            for w in group["params"]:
                g = self._grad_of(w)
                if g is None:
                    continue
                p = self._compute[id(w)]
                state = self.state[w]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":   # loaded from a fused AdamW's state: once
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                step = float(state["step"])
                step_size = lr / (1.0 - beta1 ** step)
                bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
                c = coef if coef is not None else self._one(w.device)
                args = (1.0 - lr * wd, step_size, bc2_sqrt)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if kernel_usable(w.device) and all(t.is_contiguous() for t in (g, w, m, v, p)):
                    n = w.numel()
                    _master_adamw_kernel[(triton.cdiv(n, BLOCK),)](
                        g, w, m, v, p, c, n, beta1, beta2, eps, *args, BLOCK_SIZE=BLOCK)
                else:
                    _step_torch(g, w, m, v, p, c, beta1, beta2, eps, *args)
        self.master.clear_grads()
        return None
