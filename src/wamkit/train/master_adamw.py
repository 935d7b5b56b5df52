"""AdamW on the fp32 masters of shard=none + bf16 (train/master.py) in one pass per tensor: `optimizer_impl=triton`.

The default path of one optimizer step touches every weight's bytes five times (profiled on the H200, wam-ref 1b,
batch 64: 58.7 ms of a 336 ms step, of which torch's fused AdamW itself is 20.5 ms):

    grads_to_master   bf16 grads -> fp32 master grads (a copy)
    clip_grad_norm_   the norm of the fp32 grads, then every grad multiplied by the clip coefficient
    AdamW (fused)     fp32 master, exp_avg, exp_avg_sq updated from the fp32 grad
    masters_to_model  fp32 masters -> the module's bf16 weights (a copy)

Here the module's bf16 gradient stays where backward put it; the clip norm is taken over those bf16 gradients
(accumulated in fp32); and a Triton kernel reads the bf16 gradient, scales it by the clip coefficient
(a device scalar: no host sync), updates master, exp_avg and exp_avg_sq exactly as torch's fused AdamW does, and
writes the rounded bf16 weight: 14 bytes read and 14 written per weight, against ~40 moved by the four passes.

Everything else is torch.optim.AdamW's: parameter groups (the masters), `state` (`step`, `exp_avg`, `exp_avg_sq`,
so checkpoints load into either implementation), `state_dict`, the LR scheduler. With gradient accumulation (more
than one micro-step per optimizer step) the gradients are summed in fp32 on the masters as before, and the kernel
reads those. Without a usable kernel (no Triton, or CPU tensors outside TRITON_INTERPRET=1) the same arithmetic
runs as torch ops, so results do not depend on where it runs beyond rounding.

One launch for all tensors (`_master_adamw_multi_kernel`; one per gradient dtype, so one on a step of one micro-step
and one with accumulation): a per-tensor launch costs ~60 us of host time (state lookups, the step count, Triton's
argument binding), ~30 ms a step over the ~500 tensors of wam-ref 1b, and the step is host-bound. The kernel reads
each tensor's addresses from tables, built once per set of tensors with a gradient (`_Plan`: it changes only when a
parameter gains or loses its gradient, or its gradient dtype changes, or a state is loaded): a fixed device table of
the w, m, v, p addresses, sizes and first blocks, a block -> tensor table, and per step one host-filled table of the
gradients' addresses (autograd allocates them afresh) and the tensors' scalars (decay, bias corrections and betas,
per group), copied to the device in one non-blocking copy from pinned memory. The step counts of the plan's tensors
live in one float32 CPU tensor whose 0-d views are their `state["step"]`: one `+= 1` a step, and state_dict() is
torch AdamW's. `launches` counts a step's kernel launches. Tensors the kernel cannot take (not contiguous, a device
without the kernel) are stepped one by one (`_master_adamw_kernel`, or `_step_torch`).
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch

try:   # Triton ships with CUDA builds of torch, not with CPU ones
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "no kernel"
    triton = tl = None

log = logging.getLogger(__name__)

BLOCK = 2048
# WAMKIT_MASTER_ADAMW=per-tensor: one launch per tensor (the form measured first on the H200), for A/B runs
MULTI_DEFAULT = os.environ.get("WAMKIT_MASTER_ADAMW", "multi") != "per-tensor"


class _MultiUnavailable(RuntimeError):
    """The multi-tensor kernel could not be built or launched here; nothing of the step ran."""


def kernel_usable(device: torch.device) -> bool:
    """Whether the Triton kernel runs for tensors on `device` (CUDA, or anywhere under TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _adamw_block(g_ptr, w_ptr, m_ptr, v_ptr, p_ptr, offs, mask, coef, beta1, beta2, eps, decay, step_size,
                     bc2_sqrt):
        """One block of one tensor: the arithmetic both kernels share."""
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

    @triton.jit
    def _master_adamw_kernel(g_ptr, w_ptr, m_ptr, v_ptr, p_ptr, coef_ptr, n, beta1, beta2, eps, decay, step_size,
                             bc2_sqrt, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        _adamw_block(g_ptr, w_ptr, m_ptr, v_ptr, p_ptr, offs, offs < n, tl.load(coef_ptr), beta1, beta2, eps,
                     decay, step_size, bc2_sqrt)

    @triton.jit
    def _master_adamw_multi_kernel(tab_ptr, gptr_ptr, sc_ptr, blk_ptr, coef_ptr, BLOCK_SIZE: tl.constexpr,
                                   GRAD_BF16: tl.constexpr, ALIGNED: tl.constexpr, TAB: tl.constexpr,
                                   SC: tl.constexpr):
        """All tensors of a step in one launch. Program i does block i of the launch: tensor t = blk[i] (int32),
        whose row of `tab` (int64, TAB = _TAB columns) holds the w, m, v, p addresses, its numel and its first block;
        gptr[t] is its gradient's address (bf16 or fp32: GRAD_BF16), sc[t, :] its scalars (float32, SC = _SC columns:
        beta1, beta2, eps, decay, step_size, bc2_sqrt). ALIGNED: every address is a multiple of 16 bytes (the host
        checks), which with the unmasked full blocks lets the compiler use 16-byte loads and stores."""
        pid = tl.program_id(0)
        t = tl.load(blk_ptr + pid).to(tl.int64)
        row = tab_ptr + t * TAB
        w_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        p_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
        n = tl.load(row + 4)
        first = tl.load(row + 5)
        if GRAD_BF16:
            g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.bfloat16))
        else:
            g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            g_ptr = tl.multiple_of(g_ptr, 16)
            w_ptr = tl.multiple_of(w_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
        sc = sc_ptr + t * SC
        coef = tl.load(coef_ptr)
        beta1, beta2, eps = tl.load(sc + 0), tl.load(sc + 1), tl.load(sc + 2)
        decay, step_size, bc2_sqrt = tl.load(sc + 3), tl.load(sc + 4), tl.load(sc + 5)
        start = (pid.to(tl.int64) - first) * BLOCK_SIZE
        offs = start + tl.arange(0, BLOCK_SIZE)
        if start + BLOCK_SIZE <= n:          # a full block: no mask (a constant one), so loads can be vectorized
            full = tl.full([BLOCK_SIZE], 1, tl.int1)
            _adamw_block(g_ptr, w_ptr, m_ptr, v_ptr, p_ptr, offs, full, coef, beta1, beta2, eps, decay, step_size,
                         bc2_sqrt)
        else:                                # the tensor's last block
            _adamw_block(g_ptr, w_ptr, m_ptr, v_ptr, p_ptr, offs, offs < n, coef, beta1, beta2, eps, decay,
                         step_size, bc2_sqrt)


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


_TAB = 6   # columns of the multi-tensor kernel's fixed table (int64): w, m, v, p addresses, numel, first block
_SC = 6    # its scalars per tensor (float32): beta1, beta2, eps, decay, step_size, bc2_sqrt


def _scalars(lr, beta1, beta2, eps, wd, step) -> tuple:
    """One tensor's kernel scalars for AdamW step `step` (1-based), in Python floats (rounded to fp32 once, as a
    Triton float argument is)."""
    return (beta1, beta2, eps, 1.0 - lr * wd, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step))


class _Plan:
    """The multi-tensor step's layout for one set of (tensor, gradient dtype): built when that set changes, reused
    every step while it does not (see MasterAdamW.step).

    members     (master, module parameter, gradient dtype) per row of the kernel's tables: bf16-gradient rows
                first, then fp32-gradient ones, each in group order; where the step reads the row's gradient
    absent      params without a gradient when the plan was built (one getting a gradient means a new plan)
    slow        (group index, master) stepped one tensor at a time (not contiguous or not 16-byte aligned, a
                device without the kernel)
    runs        (first row, end row, group index, uniform): rows of one group; uniform: one step count for all
    launches    (GRAD_BF16, number of blocks, table, block table, gradient addresses, scalars) views, per dtype
    steps       float32 CPU tensor of the rows' step counts; each row's state["step"] is a 0-d view of it, so one
                `+= 1` steps them all and state_dict() sees torch AdamW's format
    host, dev   the per-step table (int64: rows gradient addresses, then rows x _SC float32 scalars): filled on the
                host (two pinned buffers taking turns on CUDA, each reused once its copy is done), one copy a step
    """

    def __init__(self, opt: "MasterAdamW"):
        self.state = opt.state
        by_dtype: dict[torch.dtype, list] = {torch.bfloat16: [], torch.float32: []}
        self.absent, self.slow = [], []
        device = None
        for gi, group in enumerate(opt.param_groups):
            for w in group["params"]:
                g = opt._grad_of(w)
                if g is None:
                    self.absent.append(w)
                    continue
                st = opt._state_of(w)
                m, v, p = st["exp_avg"], st["exp_avg_sq"], opt._compute[id(w)]
                # (a gradient's layout may change from step to step: one not contiguous is read from a copy)
                ok = (opt.multi and g.dtype in by_dtype and kernel_usable(w.device)
                      and (device is None or w.device == device)
                      and w.dtype == m.dtype == v.dtype == torch.float32 and p.dtype == torch.bfloat16
                      and g.device == w.device
                      and all(t.device == w.device and t.is_contiguous() and t.data_ptr() % 16 == 0
                              for t in (w, m, v, p)))
                if ok:
                    device = w.device
                    by_dtype[g.dtype].append((gi, w, p, m, v))
                else:
                    self.slow.append((gi, w))
        rows = by_dtype[torch.bfloat16] + by_dtype[torch.float32]
        n = len(rows)
        self.members = [(w, p, dt) for dt in by_dtype for _, w, p, _, _ in by_dtype[dt]]
        self.steps = torch.tensor([float(opt.state[w]["step"]) for _, w, _, _, _ in rows], dtype=torch.float32)
        for i, (_, w, _, _, _) in enumerate(rows):
            opt.state[w]["step"] = self.steps[i]
        self.steps_np = self.steps.numpy()
        self.runs = []
        r = 0
        while r < n:
            e = r
            while e < n and rows[e][0] == rows[r][0] and (e == r or self.members[e][2] is self.members[r][2]):
                e += 1
            self.runs.append((r, e, rows[r][0], bool((self.steps_np[r:e] == self.steps_np[r]).all())))
            r = e
        self.n, self.device, self.launches = n, device, []
        if not n:
            return
        pin = device.type == "cuda"
        self.host = [torch.empty(n * (1 + _SC // 2), dtype=torch.int64, pin_memory=pin)
                     for _ in range(2 if pin else 1)]
        self.host_np = [(h.numpy()[:n], h.numpy()[n:].view("float32").reshape(n, _SC)) for h in self.host]
        self.events = [torch.cuda.Event() for _ in self.host] if pin else None
        self.turn = 0
        self.dev = torch.empty_like(self.host[0], device=device) if pin else self.host[0]
        dev_g, dev_sc = self.dev[:n], self.dev[n:].view(torch.float32)
        r0 = 0
        for dt in by_dtype:
            seg = by_dtype[dt]
            if not seg:
                continue
            blocks = [triton.cdiv(w.numel(), BLOCK) for _, w, _, _, _ in seg]
            first, tab = 0, []
            for (_, w, p, m, v), b in zip(seg, blocks):
                tab.append([w.data_ptr(), m.data_ptr(), v.data_ptr(), p.data_ptr(), w.numel(), first])   # _TAB
                first += b
            blk = torch.repeat_interleave(torch.arange(len(seg), dtype=torch.int32), torch.tensor(blocks))
            r1 = r0 + len(seg)
            self.launches.append((dt is torch.bfloat16, first, torch.tensor(tab, dtype=torch.int64).to(device),
                                  blk.to(device), dev_g[r0:r1], dev_sc[r0 * _SC:r1 * _SC]))
            r0 = r1

    def step(self, opt: "MasterAdamW", coef: torch.Tensor | None) -> bool:
        """One step of every row, or False (nothing done) where this plan no longer fits the gradients."""
        ptrs, keep = [], []
        for w, p, dt in self.members:
            g = w.grad
            if g is None:
                g = p.grad
            if g is None or g.dtype is not dt:
                return False
            if not g.is_contiguous():       # the kernel's layout (a copy of this one gradient)
                g = g.contiguous()
                keep.append(g)
            ptrs.append(g.data_ptr())
        for w in self.absent:
            if opt._grad_of(w) is not None:
                return False
        if not self.n:
            return True
        k = self.turn
        if self.events is not None:
            self.turn = 1 - k
            self.events[k].synchronize()    # this buffer's previous copy is done (a step ago at most)
        gptr, sc = self.host_np[k]
        gptr[:] = ptrs
        aligned = not (np.bitwise_or.reduce(gptr) & 15)   # (w, m, v, p: checked when the plan was built)
        steps = self.steps_np
        steps += 1
        groups = opt.param_groups
        for r0, r1, gi, uniform in self.runs:
            group = groups[gi]
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            lr = float(lr)
            if uniform:
                sc[r0:r1] = _scalars(lr, beta1, beta2, eps, wd, float(steps[r0]))
            else:
                for r in range(r0, r1):
                    sc[r] = _scalars(lr, beta1, beta2, eps, wd, float(steps[r]))
        if self.events is not None:
            self.dev.copy_(self.host[k], non_blocking=True)
            self.events[k].record()
        c = coef if coef is not None else opt._one(self.device)
        for i, (bf16, blocks, tab, blk, dev_g, dev_sc) in enumerate(self.launches):
            try:
                _master_adamw_multi_kernel[(blocks,)](tab, dev_g, dev_sc, blk, c, BLOCK_SIZE=BLOCK,
                                                      GRAD_BF16=bf16, ALIGNED=aligned, TAB=_TAB, SC=_SC)
            except Exception as e:  # noqa: BLE001 - the kernel did not build or launch here (nothing ran)
                if i:                       # a first launch already updated part of the tensors: no way back
                    raise
                steps -= 1
                raise _MultiUnavailable(e) from e
            opt.launches += 1
        del keep                            # (the stream orders the kernels before any reuse of their memory)
        return True


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over the fp32 masters of `master` (a MasterWeights), stepped by the multi-tensor kernel
    `_master_adamw_multi_kernel` (one launch per gradient dtype for all tensors; `_master_adamw_kernel`, one launch
    per tensor, and `_step_torch` remain for tensors it cannot take).

    Each master's module parameter (bf16, from `master.trainable_pairs()`) is where its gradient is read and its new
    value written. Call `clip_grad_norm_(max_norm)` before `step()` (its coefficient is applied inside the
    step; without it the coefficient is 1). `launches`: the kernel launches of the last step."""

    writes_model = True   # the step writes the module's bf16 weights and clears the gradients (TrainModel)

    def __init__(self, groups, master, lr: float, betas, eps: float):
        self._plan: _Plan | None = None
        super().__init__(groups, lr=lr, betas=betas, eps=eps, foreach=False)
        self.master = master
        master.grads_stay = True
        self._compute = {id(m): p for p, m in master.trainable_pairs()}
        self._coef: torch.Tensor | None = None
        self._ones: dict[torch.device, torch.Tensor] = {}
        self.launches = 0
        self.multi = MULTI_DEFAULT        # False: every tensor stepped by its own launch (see _MultiUnavailable)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._plan = None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._plan = None       # new state tensors (and step counts): the next step builds its plan from them

    def _grad_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step uses: the masters' fp32 sum over micro-steps, or the module's bf16 one."""
        if master.grad is not None:
            return master.grad
        p = self._compute.get(id(master))
        return None if p is None else p.grad

    def _state_of(self, w: torch.Tensor) -> dict:
        state = self.state[w]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
        elif state["step"].device.type != "cpu":   # loaded from a fused AdamW's state: once
            state["step"] = state["step"].cpu()
        return state

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
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("MasterAdamW implements plain AdamW (no amsgrad, no maximize)")
        coef, self._coef = self._coef, None
        self.launches = 0
        try:
            plan = self._step_plan(coef)
        except _MultiUnavailable as e:
            log.warning("MasterAdamW: the multi-tensor kernel is unavailable here (%s); stepping each tensor with "
                        "its own launch from now on", e.__cause__ or e)
            self.multi, self._plan = False, None
            plan = self._step_plan(coef)
        for gi, w in plan.slow:
            g = self._grad_of(w)
            if g is not None:
                self._step_one(self.param_groups[gi], w, g, coef)
        self.master.clear_grads()
        return None

    def _step_plan(self, coef: torch.Tensor | None) -> _Plan:
        """The multi-tensor part of a step (the plan rebuilt where it no longer fits); returns the plan, whose
        `slow` tensors the caller steps one by one."""
        plan = self._plan
        if plan is None or plan.state is not self.state or not plan.step(self, coef):
            plan = self._plan = _Plan(self)
            if not plan.step(self, coef):
                raise RuntimeError("MasterAdamW: a fresh multi-tensor plan does not fit its own gradients")
        return plan

    def _step_one(self, group: dict, w: torch.Tensor, g: torch.Tensor, coef: torch.Tensor | None) -> None:
        """One tensor's step: `_master_adamw_kernel` where it runs on contiguous tensors, else `_step_torch`."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        p = self._compute[id(w)]
        state = self._state_of(w)
        state["step"] += 1
        _, _, _, *args = _scalars(lr, beta1, beta2, eps, wd, float(state["step"]))
        c = coef if coef is not None else self._one(w.device)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if kernel_usable(w.device) and all(t.is_contiguous() for t in (g, w, m, v, p)):
            n = w.numel()
            _master_adamw_kernel[(triton.cdiv(n, BLOCK),)](
                g, w, m, v, p, c, n, beta1, beta2, eps, *args, BLOCK_SIZE=BLOCK)
            self.launches += 1
        else:
            _step_torch(g, w, m, v, p, c, beta1, beta2, eps, *args)
