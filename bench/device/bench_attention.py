"""The denoising loop's attention alone, at the real shapes, per K/V layout, key padding and SDPA backend.

    python3 bench/device/bench_attention.py --out $OUT/attention.json [--size nano-shape] [--batches 1,64]
        [--layouts expanded,room,folded] [--pads 0,4,12] [--backends auto,cudnn,efficient,flash,math,triton]
        [--reps 20]
        [--masks mask,none]
    python3 bench/device/bench_attention.py --out /tmp/a.json --device cpu --batches 1,2 --reps 2   # CPU smoke run

Why: at batch 64 the nano-shape loop takes ~30.5 ms a step against ~18.4 ms for its GEMMs alone (bench_gemm), and
at batch 1 the profile shows each attention call at ~12 us plus a memset, fills and copies beside it. This times
`wam_ref.model.attend` exactly as GenBlock calls it while denoising: q (B, heads, n, hd) from the action tokens,
K/V in the layout's buffer (B, heads or kv heads, prefix + pad + n slots, hd), the additive key mask of
`model.additive_mask` with the pad slots masked. The shapes come from the policy's config (built on the meta
device: no weights). On CUDA, one CUDA graph per configuration holds `layers` calls (one loop step's attention,
as the loop's graph replays it); its replays are timed with CUDA events (median of --reps) -> microseconds per call
and milliseconds per step. Each configuration's output is compared with expanded / no pad / the default backend
(max abs difference: the folded layout's numerics on the GPU). A backend that refuses a configuration is recorded
with its error, not fatal. --masks none also times each configuration with no mask at all (attn_mask=None, every
key attended: what a batch without padded keys could run, and the only case the flash backend takes); those rows
are compared with the first no-mask configuration, not with the masked reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wamkit.policies import make_policy  # noqa: E402
from wamkit.policies.wam_ref import folded_attention as fa  # noqa: E402
from wamkit.policies.wam_ref.model import additive_mask, attend, kv_room_buffer  # noqa: E402
from wamkit.policies.wam_ref.skinny import graph_us  # noqa: E402

# triton / triton-w8: attention=triton's kernel (folded layout) with 4 / 8 warps a program (folded_attention.NUM_WARPS)
BACKENDS = ("auto", "cudnn", "efficient", "flash", "math", "triton", "triton-w8")


def shapes(size: str, horizon: int, state_dim: int) -> dict:
    """The loop's attention shapes of a wam-ref size: heads, kv heads, head dim, layers, prefix length, action
    tokens (from the policy's config on the meta device)."""
    pol = make_policy("wam-ref", size=size, device="meta", dtype="bfloat16", horizon=horizon, action_dim=7,
                      state_dim=state_dim)
    tc = pol.engine.text_config
    return {"heads": tc.num_attention_heads, "kv_heads": tc.num_key_value_heads, "head_dim": tc.head_dim,
            "layers": tc.num_hidden_layers, "prefix": pol.prefix_len, "tokens": pol.gen_tokens}


def backend_ctx(name: str):
    import contextlib

    if name == "auto" or name.startswith("triton"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[name]])


def inputs(sh: dict, b: int, layout: str, pad: int, dtype, device, seed: int = 0):
    """q, k, v, additive mask for one call; the prefix's last 20% text slots masked (right-padded prompts), the
    pad slots masked, the action slots attended. Same values for every layout (expanded = kv heads repeated)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, kvh, hd, s, n = sh["heads"], sh["kv_heads"], sh["head_dim"], sh["prefix"], sh["tokens"]

    def padded(t):   # (..., s + n, hd) -> (..., s + pad + n, hd): the pad slots between prefix and action slots
        return torch.cat([t[:, :, :s], t.new_zeros(*t.shape[:2], pad, hd), t[:, :, s:]], dim=2)

    q = torch.randn(b, h, n, hd, generator=g).to(device, dtype)
    k = padded(torch.randn(b, kvh, s + n, hd, generator=g)).to(device, dtype)
    v = padded(torch.randn(b, kvh, s + n, hd, generator=g)).to(device, dtype)
    keep = torch.ones(b, s + pad + n, dtype=torch.bool)
    keep[:, int(s * 0.8):s + pad] = False
    if layout == "expanded":   # the kv heads repeated to every query head, in the loop's own layout
        k, v = kv_room_buffer(k, 0, h), kv_room_buffer(v, 0, h)
    return q, k, v, additive_mask(keep.to(device), dtype)


def run_one(sh: dict, b: int, layout: str, pad: int, backend: str, reps: int, dtype, device,
            masked: bool = True) -> dict:
    q, k, v, mask = inputs(sh, b, layout, pad, dtype, device)
    if not masked:
        mask = None
    fold = layout == "folded"
    attention = "triton" if backend.startswith("triton") else "sdpa"
    fa.NUM_WARPS = 8 if backend == "triton-w8" else 4
    kv_bytes = 2 * k.numel() * k.element_size()
    row = {"batch": b, "layout": layout, "pad": pad, "keys": k.shape[2], "backend": backend, "masked": masked,
           "kv_mb_per_call": kv_bytes / 1e6}
    try:
        if attention == "triton" and not (fold and fa.applies(q, "triton")):
            raise ValueError(f"the triton kernel runs the folded layout only, on CUDA or Triton's interpreter "
                             f"({fa.available()[1] or 'layout ' + layout})")
        with backend_ctx(backend):
            out = attend(q, k, v, mask, fold, attention)   # also the warm-up (kernel selection, cuDNN plan)
            if device.type == "cuda":   # one loop step's calls in a CUDA graph, replays timed (skinny.graph_us)
                def step():
                    for _ in range(sh["layers"]):
                        attend(q, k, v, mask, fold, attention)

                times = graph_us(step, reps=reps, calls=sh["layers"])
            else:   # CPU smoke run: host clock, no graphs
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    attend(q, k, v, mask, fold, attention)
                    times.append((time.perf_counter() - t0) * 1e6)
    except Exception as e:  # a backend that cannot take this configuration: recorded, not fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    us = statistics.median(times)
    row.update(us_per_call=us, ms_per_step=us * sh["layers"] / 1e3, kv_tb_s=kv_bytes / (us * 1e-6) / 1e12,
               out=out.float().cpu())
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="nano-shape")
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--state-dim", type=int, default=0)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--layouts", default="expanded,room,folded")
    ap.add_argument("--pads", default="0,4,12", help="extra masked key slots (276 keys + 4 = 280, + 12 = 288)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--masks", default="mask", help="mask (the loop's additive key mask), none (no mask), or both")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sh = shapes(args.size, args.horizon, args.state_dim)
    res = {"args": vars(args), "shapes": sh, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rows": []}
    print(f"shapes {sh}", flush=True)
    ref: dict[tuple[int, bool], torch.Tensor] = {}
    grid = [(b, layout, pad, backend, m) for b in [int(x) for x in args.batches.split(",") if x]
            for m in [x != "none" for x in args.masks.split(",") if x]
            for layout in [x for x in args.layouts.split(",") if x]
            for pad in [int(x) for x in args.pads.split(",") if x]
            for backend in [x for x in args.backends.split(",") if x]]
    for b, layout, pad, backend, masked in grid:
        row = run_one(sh, b, layout, pad, backend, args.reps, dtype, device, masked)
        out = row.pop("out", None)
        if out is not None:
            if (b, masked) not in ref:   # the first configuration that ran: expanded, no pad, auto
                ref[b, masked] = out
                row["reference"] = True
            row["max_abs_diff"] = float((out - ref[b, masked]).abs().max())
        res["rows"].append(row)
        tag = f"b={b:3d} {layout:9s} pad={pad:2d} {backend:9s}{'' if masked else ' nomask'}"
        if "error" in row:
            print(f"{tag} refused: {row['error']}", flush=True)
        else:
            print(f"{tag} {row['us_per_call']:8.1f} us/call "
                  f"{row['ms_per_step']:7.3f} ms/step  K/V {row['kv_mb_per_call']:8.2f} MB "
                  f"{row['kv_tb_s']:5.2f} TB/s  max|diff| {row['max_abs_diff']:.2e}", flush=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
