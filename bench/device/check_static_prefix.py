"""The training forward's static prefix (model.encode_prefix_static) against transformers' forward on the GPU: the
same loss and gradients for every parameter (understanding tower included), in bf16 and fp32, from the same weights
and batch; prints the loss difference and the largest gradient difference relative to that gradient's largest
element, and writes them as JSON. The CPU tests check fp32 (tests/test_wam_ref_fused.py).

    PYTHONPATH=src python3 bench/device/check_static_prefix.py [--size tiny] [--batch 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from wamkit.policies import make_policy


def check(size: str, batch: int, dtype: str) -> dict:
    pol = make_policy("wam-ref", size=size, device="cuda", dtype=dtype, max_text_len=20, state_dim=8)
    pol.apply_trainable_patterns(["*"])
    m = pol.module
    rng = np.random.default_rng(0)
    images = {c: torch.from_numpy(rng.integers(0, 256, (batch, pol.image_size, pol.image_size, 3), dtype=np.uint8))
              for c in pol.cameras}
    tasks = ["pick up the bowl", "open the top drawer and put the bowl inside"] * (batch // 2 + 1)
    inp = pol.prepare_inputs(images, tasks[:batch], torch.randn(batch, 8))
    g = torch.Generator(device="cuda").manual_seed(0)
    actions = torch.randn(batch, pol.horizon, pol.model_action_dim, device="cuda", generator=g)
    call = dict(inp, actions=actions, action_mask=torch.ones(batch, pol.horizon, dtype=torch.bool, device="cuda"),
                noise=torch.randn(actions.shape, device="cuda", generator=g),
                t=torch.rand(batch, device="cuda", generator=g))
    m.static_vision_kwargs(batch, call["input_ids"].device)
    out = {}
    for static in (False, True):
        m.zero_grad(set_to_none=True)
        loss = m(**call, static_prefix=static).mean()
        loss.backward()
        out[static] = loss.item(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}
    (lr, gr), (ls, gs) = out[False], out[True]
    rel = {n: ((gs[n] - gr[n]).abs().max() / gr[n].abs().max().clamp_min(1e-30)).item() for n in gr}
    worst = max(rel, key=rel.get)
    return {"size": size, "batch": batch, "dtype": dtype, "loss_ref": lr, "loss_static": ls,
            "params_with_grad": len(gr), "same_param_set": set(gr) == set(gs),
            "max_rel_grad_diff": rel[worst], "worst_param": worst,
            "bitwise_equal_grads": sum(torch.equal(gs[n], gr[n]) for n in gr)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [check(a.size, a.batch, d) for d in ("float32", "bfloat16")]
    for r in rows:
        print("static prefix check", json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
