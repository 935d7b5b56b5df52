"""Training throughput of the FSDP2 trainer step: samples/s, measured FLOPs -> MFU, peak memory.

    python bench/bench_train.py                                   # CPU: wam-ref tiny on 1 and 2 ranks (gloo)
    python bench/bench_train.py device=cuda size=small nproc=1,8 batch=64 peak_tflops=989   # GPU (NCCL, bf16, AC)
    python bench/bench_train.py device=cuda size=1b nproc=1 batch=64 trainable=all json=$OUT/sft.json   # full SFT

trainable: "" = the policy's default patterns (wam-ref: the generation tower), "all" = every parameter, or comma
separated globs. json=PATH also writes the rows as JSON. compile=true: torch.compile of each FSDP unit;
optimizer=auto|fused|foreach (AdamW kernels; auto = fused on CUDA); activation_checkpointing=auto|true|false;
profile=true: a torch.profiler table of one more step (CUDA only) in the JSON.

Each nproc value relaunches this script under torch.distributed.run. What is timed: the trainer's step on synthetic
batches in the policy's training format (policy.sft_loss forward + backward, grad clip, AdamW step) under the same
parallelize() as `wamkit train`; data loading is NOT included. FLOPs are measured once with
torch.utils.flop_counter.FlopCounterMode on the unsharded model (forward + backward of one micro-batch, all ranks
together = global batch); MFU = measured FLOPs per step / step time / (nproc * peak_tflops). Results are appended to
bench/results/train.md (or out=...).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DEFAULTS = {"device": "cpu", "policy": "wam-ref", "size": "tiny", "nproc": "1,2", "batch": "8", "steps": "8",
            "warmup": "2", "peak_tflops": "989", "out": str(ROOT / "bench" / "results" / "train.md"),
            "activation_checkpointing": "auto", "mixed_precision": "auto", "note": "", "trainable": "",
            "json": "", "compile": "false", "optimizer": "auto", "profile": "false"}


def parse(argv):
    kv = dict(DEFAULTS)
    for a in argv:
        k, _, v = a.partition("=")
        if k not in kv:
            sys.exit(f"unknown key {k!r}; keys: {', '.join(kv)}")
        kv[k] = v
    return kv


def synthetic_batch(policy, b: int, device):
    import numpy as np
    import torch

    spec = policy.spec
    g = np.random.default_rng(0)
    size = spec.input.image_size or 64
    d = getattr(policy, "model_action_dim", spec.action.dim)
    # images stay on the host (uint8, as the data loader yields them): the policy's preprocessing reads them there
    images = {c: torch.from_numpy(g.integers(0, 256, (b, size, size, 3), dtype=np.uint8)) for c in spec.input.cameras}
    batch = {
             "task": ["put the bowl on the plate"] * b,
             "actions": torch.randn(b, spec.action.horizon, d).clamp(-1, 1),
             "action_mask": torch.ones(b, spec.action.horizon, dtype=torch.bool)}
    if spec.input.state_dim:
        batch["state"] = torch.randn(b, spec.input.state_dim)
    out = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    out["images"] = images
    return out


def worker(kv):
    import resource

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from wamkit.train.config import TrainConfig
    from wamkit.train.dist import close_distributed, init_distributed
    from wamkit.train.optim import build_optimizer, count_params, select_trainable
    from wamkit.train.parallelize import parallelize, resolved_precision
    from wamkit.train.trainer import build_policy

    info = init_distributed(kv["device"])
    world, rank = info.world_size, info.rank
    micro = int(kv["batch"]) // world
    torch.manual_seed(0)
    policy = build_policy(kv["policy"], {"size": kv["size"]}, device=str(info.device))
    module = policy.module
    tr = kv["trainable"]
    patterns = (["*"] if tr == "all" else tr.split(",")) if tr else list(getattr(policy, "trainable_patterns", []) or [])
    if hasattr(policy, "apply_trainable_patterns"):
        policy.apply_trainable_patterns(patterns)
    select_trainable(module, patterns)
    module.float().train()
    total, trainable = count_params(module)
    batch = synthetic_batch(policy, micro, info.device)
    # measured FLOPs (forward + backward), unsharded, before parallelize, on up to 4 samples (every op is per
    # sample, so FLOPs scale linearly with the batch; a fp32 unsharded pass over a large micro-batch would not fit)
    fb = min(micro, 4)
    flops = FlopCounterMode(display=False)
    with flops:
        loss, _ = policy.sft_loss(synthetic_batch(policy, fb, info.device))
        loss.backward()
    step_flops = flops.get_total_flops() * (micro / fb) * world          # all ranks together = one global batch
    module.zero_grad(set_to_none=True)
    ac = kv["activation_checkpointing"]
    ac = (info.device.type == "cuda") if ac == "auto" else ac.lower() in ("1", "true", "yes")
    comp = kv["compile"].lower() in ("1", "true", "yes")
    parallelize(module, list(policy.fsdp_units()), info.device.type, world, mixed_precision=kv["mixed_precision"],
                activation_checkpointing=ac, compile=comp)
    cfg = TrainConfig(optimizer_impl=kv["optimizer"])
    opt = build_optimizer(module, cfg, dict(policy.lr_multipliers()))
    params = [p for p in module.parameters() if p.requires_grad]
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(int(kv["warmup"]) + int(kv["steps"])):
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss, _ = policy.sft_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    prof_table = None
    if kv["profile"].lower() in ("1", "true", "yes") and info.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loss, _ = policy.sft_loss(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        prof_table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
    t_step = sum(times[int(kv["warmup"]):]) / int(kv["steps"])
    t_all = torch.tensor([t_step], dtype=torch.float64)
    torch.distributed.all_reduce(t_all, op=torch.distributed.ReduceOp.MAX)
    t_step = float(t_all)
    if info.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    res = {"nproc": world, "device": info.device.type, "precision": resolved_precision(kv["mixed_precision"],
                                                                                           info.device.type),
           "ac": ac, "compile": comp, "optimizer": kv["optimizer"], "params_M": total / 1e6, "trainable_M": trainable / 1e6, "global_batch": micro * world,
           "step_s": t_step, "samples_per_s": micro * world / t_step, "tflop_per_step": step_flops / 1e12,
           "achieved_tflops": step_flops / t_step / 1e12,
           "mfu": step_flops / t_step / (world * float(kv["peak_tflops"]) * 1e12) if info.device.type == "cuda"
           else None, "peak_mem_gib_rank0": peak, "size": kv["size"], "trainable": kv["trainable"] or "default",
           "step_times_s": times, "profile": prof_table}
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    close_distributed(info)


def main(argv):
    if argv and argv[0] == "worker":
        return worker(parse(argv[1:]))
    kv = parse(argv)
    rows = []
    for n in [int(x) for x in kv["nproc"].split(",")]:
        args = [f"{k}={v}" for k, v in kv.items() if k != "nproc"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               str(Path(__file__).resolve()), "worker", *args]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        # torchrun sets OMP_NUM_THREADS=1 only for nproc > 1; 1 thread per rank everywhere makes the rows
        # comparable (on the shared 2-core box, 2 threads for 1 rank ran ~9x slower than 1 thread: contention)
        env.setdefault("OMP_NUM_THREADS", "1")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            print(p.stdout[-2000:], p.stderr[-4000:])
            sys.exit(f"nproc={n} failed")
        r = json.loads(line[0][7:])
        print(r)
        rows.append(r)
    if kv["json"]:
        Path(kv["json"]).write_text(json.dumps({"kv": kv, "rows": rows}, indent=2))
    write(kv, rows, argv)


def write(kv, rows, argv):
    out = Path(kv["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    dev = rows[0]["device"]
    if dev == "cuda":
        import torch

        machine = f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
    else:
        machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores (shared with other work)"
    lines = [f"\n## {kv['policy']} {kv['size']} on {dev} ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')})", "",
             f"- command: `python bench/bench_train.py {' '.join(argv)}`",
             f"- machine: {machine}; torch {__import__('torch').__version__}; load average "
             f"{os.getloadavg()[0]:.1f} at the end",
             f"- OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} per rank",
             "- timed: trainer step on synthetic batches (sft_loss fwd+bwd, clip, AdamW), no data loading; FLOPs "
             "measured with FlopCounterMode (fwd+bwd of the global batch); MFU vs "
             f"{kv['peak_tflops']} TFLOP/s per GPU" + (f"; {kv['note']}" if kv["note"] else ""), "",
             "| ranks | precision | act. ckpt | params (trainable) | global batch | step s | samples/s | "
             "TFLOP/step | TFLOP/s | MFU | peak mem GiB (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"| {r['nproc']} | {r['precision']} | {r['ac']} | {r['params_M']:.2f}M ({r['trainable_M']:.2f}M)"
                     f" | {r['global_batch']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | "
                     f"{r['tflop_per_step']:.4f} | {r['achieved_tflops']:.3f} | {mfu} | "
                     f"{r['peak_mem_gib_rank0']:.2f} |")
    if not out.exists():
        out.write_text("# Training throughput (bench/bench_train.py)\n")
    with open(out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
