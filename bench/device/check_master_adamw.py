"""optimizer_impl=triton against the default shard=none path on the GPU (the CPU tests run the kernel in Triton's
interpreter): a few AdamW steps with the clip engaged on a stack of bf16 Linear layers, both ways from the same
weights and batches; prints the largest relative difference of the fp32 masters and of the moments, whether every
bf16 weight is its master rounded, whether the multi-tensor kernel equals the per-tensor one bit for bit, and the
optimizer phase's device time (grads -> clip -> step -> weights) of each.
Step 1 is the check of the arithmetic (same weights, same batch: the same bf16 gradients go into both optimizers);
after more steps the two trajectories drift apart through the forward (a bf16 weight one rounding apart changes
near-zero gradients' signs, and AdamW moves every such element by ~lr), so later steps are shown, not judged.

    PYTHONPATH=src python3 bench/device/check_master_adamw.py [--width 4096] [--layers 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn as nn

from wamkit.train.config import TrainConfig
from wamkit.train.optim import build_optimizer, clip_gradients
from wamkit.train.parallelize import setup_model


def run(impl: str, width: int, layers: int, steps: int, multi: bool = True):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda().float()
    model = setup_model(net, [], "cuda", 1, shard="none", mixed_precision="bf16")
    opt = build_optimizer(model.state, TrainConfig(lr=1e-3, weight_decay=0.1, optimizer_impl=impl), {},
                          master=model.master)
    if impl == "triton":
        opt.multi = multi          # MasterAdamW: one launch for every tensor, or one per tensor
    params = [p for p in model.state.parameters() if p.requires_grad]
    ms = []
    for s in range(steps):
        g = torch.Generator(device="cuda").manual_seed(s)
        x = torch.randn(256, width, device="cuda", generator=g, dtype=torch.bfloat16)
        loss = net(x).float().pow(2).mean()
        loss.backward()
        model.after_backward(True, True)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        clip_gradients(opt, params, 0.1)
        opt.step()
        model.after_optimizer_step(opt)
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    masters = [p.detach().clone() for p in model.state.parameters()]
    compute = [p.detach().clone() for p in net.parameters()]
    moments = [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in model.state.parameters()]
    return masters, compute, moments, ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    ref = run("fused", a.width, a.layers, a.steps)
    got = run("triton", a.width, a.layers, a.steps)
    one = run("triton", a.width, a.layers, a.steps, multi=False)

    def rel(x, y):
        return max(float((u - v).abs().max() / v.abs().max().clamp_min(1e-30)) for u, v in zip(x, y))

    out = {"params_M": sum(p.numel() for p in ref[0]) / 1e6,
           "max_rel_diff_masters": rel(got[0], ref[0]),
           "max_rel_diff_exp_avg": rel([m for m, _ in got[2]], [m for m, _ in ref[2]]),
           "max_rel_diff_exp_avg_sq": rel([v for _, v in got[2]], [v for _, v in ref[2]]),
           "bf16_is_master_rounded": all(torch.equal(c, m.to(torch.bfloat16)) for c, m in zip(got[1], got[0])),
           "bf16_weights_equal_fraction": float(sum(int((c == r).sum()) for c, r in zip(got[1], ref[1]))
                                                / sum(c.numel() for c in got[1])),
           "multi_equals_per_tensor": all(torch.equal(x, y) for x, y in zip(got[0] + got[1], one[0] + one[1])),
           "opt_ms_fused_path": ref[3], "opt_ms_triton": got[3], "opt_ms_triton_per_tensor": one[3]}
    print("MASTER_ADAMW " + json.dumps(out), flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    out["steps"] = a.steps
    ok = (out["bf16_is_master_rounded"] and out["multi_equals_per_tensor"]
          and (a.steps > 1 or out["max_rel_diff_masters"] < 1e-5))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
