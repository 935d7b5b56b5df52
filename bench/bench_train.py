"""Training throughput of the FSDP2 trainer step: samples/s, measured FLOPs -> MFU, peak memory, and what varies
from run to run (per-step times, host vs device time, data-loader wait, host syncs, allocator, GPU clocks/power).

    python bench/bench_train.py                                   # CPU: wam-ref tiny on 1 and 2 ranks (gloo), 1 run
    python bench/bench_train.py device=cuda size=1b nproc=1 batch=64 trainable=all json=$OUT/sft.json  # full SFT
    python bench/bench_train.py device=cuda size=1b nproc=1 batch=128 activation_checkpointing=vision \\
        reshard_after_forward=auto data=loader                    # a candidate: larger micro-batch, loader in the loop

Keys (key=value): device cpu|cuda; policy, size; nproc (comma list: one set of runs per value); batch (GLOBAL batch
per optimizer step); grad_accum (micro-steps per step: micro-batch = batch / (nproc x grad_accum)); steps (measured
steps per run, after warmup; auto = 20 on cuda, 8 on cpu); warmup (auto = 3 / 2); runs (separate processes of the
same command; auto = 3 on cuda, 1 on cpu); the trainer's options activation_checkpointing (none|full|vision|globs;
default none = the trainer's default), shard (auto|fsdp|none: auto = none on one rank, fsdp on more, as the
trainer), reshard_after_forward (true|false|auto), mixed_precision, cast_root_inputs, optimizer
(auto|fused|foreach|for-loop), compile (none|full|vision|model|globs: model = the whole module, shard=none), gc_every
(0 = Python's automatic GC; N = off, one collection every N steps); trainable ("" = the policy's patterns, "all", or
comma-separated globs); data=synthetic (one fixed batch, no loading) | loader (a DataLoader with num_workers workers
and pinned memory over synthetic uint8 samples, through the trainer's DevicePrefetcher: on the device one batch
ahead, from a background thread on CUDA: the data path's own cost, no decoding); alloc_conf
(PYTORCH_CUDA_ALLOC_CONF of the runs, e.g. expandable_segments:True); syncs=true (CUDA: one more step under
torch.cuda.set_sync_debug_mode("warn"), host syncs counted by call site); profile=true (CUDA: a torch.profiler
table of one more step, first run only); smi_ms (nvidia-smi sampling period, 0 = off); json=PATH;
out=PATH (markdown appended; bench/results/train.md by default); note.

Per step (each run): step_s (wall, the CUDA device synchronized at its end), host_s (until the host had issued the
whole step: forward, backward, clip, AdamW; split into fwd_s / bwd_s / opt_s by when each call returned), gpu_lag_s
(how long the final synchronize waited: ~0 means the device had nothing queued, i.e. the step was bound by the
host), cpu_s (process CPU time, all threads), data_wait_s (time blocked on the loader). FLOPs are measured once per
run with torch.utils.flop_counter.FlopCounterMode on the unsharded model (forward + backward of a micro-batch of up
to 4 samples, scaled: every op is per sample); MFU = FLOPs per step / median step time / (nproc x peak_tflops). A
run's figure is its median step; the headline is the median over runs, with the runs' spread ((max - min) / median).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DEFAULTS = {"device": "cpu", "policy": "wam-ref", "size": "tiny", "nproc": "1,2", "batch": "8", "grad_accum": "1",
            "steps": "auto", "warmup": "auto", "runs": "auto", "peak_tflops": "989",
            "out": str(ROOT / "bench" / "results" / "train.md"), "activation_checkpointing": "none",
            "reshard_after_forward": "true", "mixed_precision": "auto", "note": "", "trainable": "", "json": "",
            "compile": "false", "optimizer": "auto", "profile": "false", "data": "synthetic", "num_workers": "2",
            "alloc_conf": "", "syncs": "true", "smi_ms": "200", "gc_every": "0",
            "cast_root_inputs": "true", "shard": "auto"}
SMI_FIELDS = ["index", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu",
              "clocks_throttle_reasons.active"]


def parse(argv):
    kv = dict(DEFAULTS)
    for a in argv:
        k, _, v = a.partition("=")
        if k not in kv:
            sys.exit(f"unknown key {k!r}; keys: {', '.join(kv)}")
        kv[k] = v
    cuda = kv["device"] == "cuda"
    for k, gpu, cpu in (("steps", 20, 8), ("warmup", 3, 2), ("runs", 3, 1)):
        if kv[k] == "auto":
            kv[k] = str(gpu if cuda else cpu)
    if kv["data"] not in ("synthetic", "loader"):
        sys.exit(f"data must be synthetic or loader, got {kv['data']!r}")
    return kv


def truthy(v: str) -> bool:
    return str(v).lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------------- batches
KERNEL_CATEGORIES = (   # first match wins; names as the CUDA kernels are called (cuBLAS, FlashAttention, Inductor)
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("copy/cast", ("memcpy", "memset", "copy_kernel", "cat_", "to_copy")),
    ("reduction", ("reduce", "norm", "softmax")),
    ("inductor fused", ("triton_",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_categories(prof) -> str:
    """The profiled step's CUDA kernel time by kind, and the device's idle share of the step's span (the wall time
    from its first kernel's start to its last kernel's end that no kernel ran: host-bound gaps)."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not kernels:
        return "kernel categories: no CUDA kernels recorded"
    by: dict[str, float] = {}
    count: dict[str, int] = {}
    spans = []
    for e in kernels:
        name = e.name.lower()
        cat = next((c for c, keys in KERNEL_CATEGORIES if any(k in name for k in keys)), "other")
        us = float(e.time_range.end - e.time_range.start)
        by[cat] = by.get(cat, 0.0) + us
        count[cat] = count.get(cat, 0) + 1
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s0, e0 in spans[1:]:   # the union of kernel intervals (streams may overlap)
        if s0 > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    total = sum(by.values())
    lines = [f"kernel categories (one step; span {span / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms = "
             f"{busy / span:.1%}, idle {(span - busy) / 1e3:.1f} ms):",
             "| kind | kernels | ms | share of kernel time |", "|---|---|---|---|"]
    for cat, us in sorted(by.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {count[cat]} | {us / 1e3:.1f} | {us / total:.1%} |")
    return "\n".join(lines)


def synthetic_batch(policy, b: int, device, seed: int = 0):
    import numpy as np
    import torch

    spec = policy.spec
    g = np.random.default_rng(seed)
    size = spec.input.image_size or 64
    d = getattr(policy, "model_action_dim", spec.action.dim)
    images = {c: torch.from_numpy(g.integers(0, 256, (b, size, size, 3), dtype=np.uint8)) for c in spec.input.cameras}
    batch = {"task": ["put the bowl on the plate"] * b,
             "actions": torch.from_numpy(g.standard_normal((b, spec.action.horizon, d), dtype=np.float32)).clamp(-1, 1),
             "action_mask": torch.ones(b, spec.action.horizon, dtype=torch.bool)}
    if spec.input.state_dim:
        batch["state"] = torch.from_numpy(g.standard_normal((b, spec.input.state_dim), dtype=np.float32))
    batch["images"] = images
    # where the trainer's prefetcher puts them: on the device, but for the policy's host keys
    from wamkit.train.data import to_device
    from wamkit.train.trainer import host_keys_of

    return to_device(batch, device, host_keys_of(policy))


class SyntheticSamples:
    """Training samples in the collated-item format of wamkit.data.samples (uint8 HxWx3 images per camera, task,
    actions, mask, state), drawn per index: what the data loader moves, without reading or decoding files."""

    def __init__(self, policy, n: int = 4096):
        spec = policy.spec
        self.n, self.cams, self.size = n, list(spec.input.cameras), spec.input.image_size or 64
        self.h, self.d = spec.action.horizon, getattr(policy, "model_action_dim", spec.action.dim)
        self.state_dim = spec.input.state_dim

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np
        import torch

        g = np.random.default_rng(i)
        it = {"images": {c: torch.from_numpy(g.integers(0, 256, (self.size, self.size, 3), dtype=np.uint8))
                         for c in self.cams},
              "task": "put the bowl on the plate",
              "actions": torch.from_numpy(g.standard_normal((self.h, self.d), dtype=np.float32)).clamp(-1, 1),
              "action_mask": torch.ones(self.h, dtype=torch.bool)}
        if self.state_dim:
            it["state"] = torch.from_numpy(g.standard_normal(self.state_dim, dtype=np.float32))
        return it


def batch_source(kv, policy, micro: int, device):
    """A callable giving the next micro-batch on the device (images on the host, as the trainer leaves them)."""
    if kv["data"] == "synthetic":
        batch = synthetic_batch(policy, micro, device)
        return lambda: batch, None
    import torch

    from wamkit.data.samples import collate
    from wamkit.train.data import DevicePrefetcher
    from wamkit.train.trainer import host_keys_of

    nw = int(kv["num_workers"])
    loader = torch.utils.data.DataLoader(SyntheticSamples(policy), batch_size=micro, shuffle=True, drop_last=True,
                                         collate_fn=collate, num_workers=nw, pin_memory=device.type == "cuda",
                                         persistent_workers=nw > 0)
    state = {"it": iter(loader)}

    def take():
        try:
            b = next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            b = next(state["it"])
        return b, None
    pre = DevicePrefetcher(take, device, host_keys_of(policy), thread=device.type == "cuda" and nw > 0)
    return pre.next, pre


# ---------------------------------------------------------------------------------------------------- probes
class SmiSampler:
    """nvidia-smi every `ms` milliseconds in the background (all GPUs): clocks, power, temperature, utilization,
    throttle reasons. Absent nvidia-smi: no samples."""

    def __init__(self, ms: int):
        self.ms, self.rows, self.proc, self.fields = ms, [], None, list(SMI_FIELDS)

    def start(self):
        import shutil

        if self.ms <= 0 or not shutil.which("nvidia-smi"):
            return self
        q = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        if q.returncode:   # an older driver without the throttle-reason field
            self.fields = self.fields[:-1]
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(self.fields)}",
                                      "--format=csv,noheader,nounits", "-lms", str(self.ms)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            vals = [v.strip() for v in line.split(",")]
            if len(vals) == len(self.fields):
                self.rows.append(dict(zip(self.fields, vals), t=time.time()))

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        self.proc.wait(timeout=5)
        out = {}
        for idx in sorted({r["index"] for r in self.rows}):
            rows = [r for r in self.rows if r["index"] == idx]
            s = {"samples": len(rows)}
            for f in ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu"):
                xs = [float(r[f]) for r in rows if _num(r[f])]
                if xs:
                    s[f] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
            if "clocks_throttle_reasons.active" in self.fields:
                s["throttle_reasons"] = sorted({r["clocks_throttle_reasons.active"] for r in rows})
            s["series"] = [[round(r["t"], 2)] + [r[f] for f in self.fields[1:]] for r in rows]
            out[f"gpu{idx}"] = s
        return out


def _num(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def host_info() -> dict:
    info = {"cpu_count": os.cpu_count(), "loadavg": list(os.getloadavg()), "platform": platform.platform()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        mhz = [float(ln.split(":", 1)[1]) for ln in lines if ln.startswith("cpu MHz")]
        info["cpu_model"] = names[0] if names else platform.processor()
        if mhz:
            info["cpu_mhz_mean"] = sum(mhz) / len(mhz)
    except OSError:
        info["cpu_model"] = platform.processor()
    return info


ALLOC_KEYS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "reserved_bytes.all.current",
              "reserved_bytes.all.peak", "allocated_bytes.all.peak", "inactive_split_bytes.all.current")


def alloc_stats(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    st = torch.cuda.memory_stats(device)
    return {k: int(st.get(k, 0)) for k in ALLOC_KEYS}


def count_syncs(step_fn) -> dict:
    """One step under torch.cuda.set_sync_debug_mode("warn"): the synchronizing calls by Python call site."""
    import collections
    import warnings

    import torch

    sites: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()   # after the mode is reset: this explicit sync is the harness's, not the step's
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return {"total": sum(sites.values()), "by_site": dict(sites.most_common(15))}


# ---------------------------------------------------------------------------------------------------- one run
def worker(kv):
    import resource

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from wamkit.train.config import TrainConfig, module_selection
    from wamkit.train.dist import close_distributed, init_distributed
    from wamkit.train.optim import build_optimizer, clip_gradients, count_params, select_trainable
    from wamkit.train.parallelize import resolved_precision, resolved_reshard, setup_model
    from wamkit.train.trainer import build_policy

    t_start = time.perf_counter()
    info = init_distributed(kv["device"])
    world, rank, dev = info.world_size, info.rank, info.device
    cuda = dev.type == "cuda"
    ga = int(kv["grad_accum"])
    if int(kv["batch"]) % (world * ga):
        sys.exit(f"batch={kv['batch']} is not divisible by nproc x grad_accum = {world} x {ga}")
    micro = int(kv["batch"]) // (world * ga)
    torch.manual_seed(0)
    policy = build_policy(kv["policy"], {"size": kv["size"]}, device=str(dev))
    module = policy.module
    tr = kv["trainable"]
    patterns = ((["*"] if tr == "all" else tr.split(",")) if tr
                else list(getattr(policy, "trainable_patterns", []) or []))
    if hasattr(policy, "apply_trainable_patterns"):
        policy.apply_trainable_patterns(patterns)
    select_trainable(module, patterns)
    module.float().train()
    total, trainable = count_params(module)
    # measured FLOPs (forward + backward), unsharded, before parallelize, on up to 4 samples (every op is per
    # sample, so FLOPs scale linearly with the batch; a fp32 unsharded pass over a large micro-batch would not fit)
    fb = min(micro, 4)
    flops = FlopCounterMode(display=False)
    with flops:
        loss, _ = policy.sft_loss(synthetic_batch(policy, fb, dev))
        loss.backward()
    step_flops = flops.get_total_flops() * (micro / fb) * world * ga      # all ranks, all micro-steps: one step
    module.zero_grad(set_to_none=True)
    ac = module_selection(kv["activation_checkpointing"], "activation_checkpointing")
    comp = module_selection(kv["compile"], "compile", allow_model=True)
    t_setup = time.perf_counter()
    model = setup_model(module, list(policy.fsdp_units()), dev.type, world, shard=kv["shard"],
                        mixed_precision=kv["mixed_precision"], activation_checkpointing=ac, compile=comp,
                        reshard_after_forward=kv["reshard_after_forward"],
                        cast_root_inputs=truthy(kv["cast_root_inputs"]))
    cfg = TrainConfig(optimizer_impl=kv["optimizer"])
    opt = build_optimizer(model.state, cfg, dict(policy.lr_multipliers()), master=model.master)
    params = [p for p in model.state.parameters() if p.requires_grad]
    next_batch, loader = batch_source(kv, policy, micro, dev)
    phases = ("data_wait_s", "fwd_s", "bwd_s", "opt_s")
    rec = dict.fromkeys(phases, 0.0)

    def step():
        # host-side phase times: when each call returned (the policy's own host syncs make fwd_s include device time)
        for k in range(ga):
            t = time.perf_counter()
            batch = next_batch()
            t1 = time.perf_counter()
            model.before_backward(k == ga - 1)
            loss, _ = policy.sft_loss(batch)
            t2 = time.perf_counter()
            (loss / ga if ga > 1 else loss).backward()
            model.after_backward(k == 0, k == ga - 1)
            t3 = time.perf_counter()
            rec["data_wait_s"] += t1 - t
            rec["fwd_s"] += t2 - t1
            rec["bwd_s"] += t3 - t2
        t = time.perf_counter()
        clip_gradients(opt, params, 1.0)
        opt.step()
        model.after_optimizer_step(opt)
        rec["opt_s"] += time.perf_counter() - t

    warmup, steps = int(kv["warmup"]), int(kv["steps"])
    gc_every = int(kv["gc_every"])
    if gc_every:   # as the trainer's gc_every: automatic GC off, one collection every N steps
        import gc

        gc.collect()
        gc.disable()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_built = time.perf_counter()
    first_step_s = None   # the first (warm-up) step: compile time (compile=...) lands here
    per_step = {k: [] for k in ("step_s", "host_s", "gpu_lag_s", "cpu_s", *phases)}
    smi = None
    for i in range(warmup + steps):
        if i == warmup:
            alloc0 = alloc_stats(dev)
            smi = SmiSampler(int(kv["smi_ms"]) if cuda and rank == 0 else 0).start()
        if cuda:
            torch.cuda.synchronize()
        rec.update(dict.fromkeys(phases, 0.0))
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        if gc_every and (i + 1) % gc_every == 0:
            gc.collect(1)   # counted in this step's time, as in the trainer's loop
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i == 0:
            first_step_s = t2 - t0
        for k, v in (("step_s", t2 - t0), ("host_s", t1 - t0), ("gpu_lag_s", t2 - t1),
                     ("cpu_s", time.process_time() - c0), *rec.items()):
            per_step[k].append(v)
    gpu = smi.stop() if smi is not None else {}
    alloc1 = alloc_stats(dev)
    syncs = count_syncs(step) if cuda and truthy(kv["syncs"]) else None
    prof_table = None
    if truthy(kv["profile"]) and cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        prof_table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        try:
            prof_table += "\n" + kernel_categories(prof)
        except Exception as e:  # noqa: BLE001 - the table above stands on its own
            prof_table += f"\nkernel categories failed: {e!r}"
    measured = {k: v[warmup:] for k, v in per_step.items()}
    med = {k: statistics.median(v) for k, v in measured.items()}
    # the slowest rank's median step is the step time of the group
    t_all = torch.tensor([med["step_s"]], dtype=torch.float64)
    torch.distributed.all_reduce(t_all, op=torch.distributed.ReduceOp.MAX)
    t_step = float(t_all)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    steps_s = measured["step_s"]
    res = {"nproc": world, "device": dev.type, "precision": resolved_precision(kv["mixed_precision"], dev.type),
           "shard": model.shard, "ac": ac, "compile": comp, "optimizer": kv["optimizer"],
           "reshard_after_forward": resolved_reshard(kv["reshard_after_forward"], world), "data": kv["data"],
           "gc_every": gc_every, "cast_root_inputs": truthy(kv["cast_root_inputs"]),
           "params_M": total / 1e6, "trainable_M": trainable / 1e6, "global_batch": micro * world * ga,
           "micro_batch": micro, "grad_accum": ga, "step_s": t_step, "samples_per_s": micro * world * ga / t_step,
           "tflop_per_step": step_flops / 1e12, "achieved_tflops": step_flops / t_step / 1e12,
           "mfu": step_flops / t_step / (world * float(kv["peak_tflops"]) * 1e12) if cuda else None,
           "peak_mem_gib_rank0": peak, "size": kv["size"], "trainable": kv["trainable"] or "default",
           "step_times_s": per_step["step_s"], "warmup": warmup, "measured_steps": steps,
           "median": med, "mean_step_s": statistics.fmean(steps_s),
           "step_cv": statistics.pstdev(steps_s) / statistics.fmean(steps_s) if len(steps_s) > 1 else 0.0,
           "per_step": {k: [round(x, 5) for x in v] for k, v in measured.items()},
           "host_bound_fraction": med["host_s"] / med["step_s"] if med["step_s"] else None,
           "alloc": {"before": alloc0, "after": alloc1,
                     "delta": {k: alloc1[k] - alloc0[k] for k in alloc1 if k.startswith("num_")}} if cuda else None,
           "gpu_samples": gpu, "host_syncs_per_step": syncs, "host": host_info(),
           "env": {k: os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
                                                      "CUDA_DEVICE_MAX_CONNECTIONS")},
           "torch": torch.__version__, "gpu_name": torch.cuda.get_device_name(dev) if cuda else None,
           "build_s": t_built - t_start, "setup_s": t_built - t_setup, "first_step_s": first_step_s,
           "profile": prof_table}
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    if loader is not None:
        loader.close()
    close_distributed(info)


# ---------------------------------------------------------------------------------------------------- driver
def summarize(rows: list[dict]) -> dict:
    """Runs of one command: the median over runs of each run's median step, and the spread between runs."""
    sps = [r["samples_per_s"] for r in rows]
    med = statistics.median(sps)
    pooled = statistics.median([x for r in rows for x in r["per_step"]["step_s"]])
    r0 = rows[0]
    out = {"nproc": r0["nproc"], "shard": r0["shard"], "runs": len(rows), "global_batch": r0["global_batch"],
           "samples_per_s": med,
           "per_run_samples_per_s": sps, "spread": (max(sps) - min(sps)) / med if med else 0.0,
           "pooled_median_step_s": pooled, "pooled_samples_per_s": r0["global_batch"] / pooled,
           "per_run_step_cv": [r["step_cv"] for r in rows],
           "per_run_host_bound_fraction": [r["host_bound_fraction"] for r in rows],
           "per_run_median_data_wait_s": [r["median"]["data_wait_s"] for r in rows],
           "per_run_median_gpu_lag_s": [r["median"]["gpu_lag_s"] for r in rows],
           "per_run_build_s": [r["build_s"] for r in rows], "per_run_first_step_s": [r["first_step_s"] for r in rows],
           "tflop_per_step": r0["tflop_per_step"], "peak_mem_gib_rank0": max(r["peak_mem_gib_rank0"] for r in rows)}
    if r0["mfu"] is not None:
        mfus = [r["mfu"] for r in rows]
        out.update(mfu=statistics.median(mfus), per_run_mfu=mfus)
    else:
        out["mfu"] = None
    if r0.get("alloc"):
        out["per_run_alloc_retries"] = [r["alloc"]["delta"].get("num_alloc_retries", 0) for r in rows]
        out["per_run_cuda_mallocs"] = [r["alloc"]["delta"].get("num_device_alloc", 0) for r in rows]
    clocks = [r["gpu_samples"].get("gpu0", {}).get("clocks.sm", {}).get("median") for r in rows]
    if any(c is not None for c in clocks):
        out["per_run_median_sm_clock_mhz"] = clocks
        out["per_run_median_power_w"] = [r["gpu_samples"].get("gpu0", {}).get("power.draw", {}).get("median")
                                         for r in rows]
    return out


def run_once(kv, n: int) -> dict:
    args = [f"{k}={v}" for k, v in kv.items() if k != "nproc"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(Path(__file__).resolve()), "worker", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # torchrun sets OMP_NUM_THREADS=1 only for nproc > 1; 1 thread per rank everywhere makes the rows
    # comparable (on the shared 2-core box, 2 threads for 1 rank ran ~9x slower than 1 thread: contention)
    env.setdefault("OMP_NUM_THREADS", "1")
    if kv["alloc_conf"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = kv["alloc_conf"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        print(p.stdout[-2000:], p.stderr[-4000:])
        errs = [ln for ln in p.stderr.splitlines() if "Error" in ln][-5:]   # the cause, above torchrun's summary
        return {"failed": True, "nproc": n, "rc": p.returncode, "errors": errs, "stderr_tail": p.stderr[-3000:]}
    return json.loads(line[0][7:])


def main(argv):
    if argv and argv[0] == "worker":
        return worker(parse(argv[1:]))
    kv = parse(argv)
    rows, summaries, failures = [], [], []

    def dump():   # after every run: a call cut short by its time limit keeps the runs it finished
        if kv["json"]:
            Path(kv["json"]).write_text(json.dumps({"kv": kv, "summary": summaries, "rows": rows,
                                                    "failures": failures}, indent=2))

    for n in [int(x) for x in kv["nproc"].split(",")]:
        runs = []
        for k in range(int(kv["runs"])):
            r = run_once(kv if k == 0 else {**kv, "profile": "false"}, n)   # the profile: first run only
            r["run"] = k
            if r.get("failed"):   # the same command would fail again (out of memory, ...): next nproc
                print(f"nproc={n} run {k} failed (rc {r['rc']})", flush=True)
                failures.append(r)
                dump()
                break
            print({x: r[x] for x in ("nproc", "run", "samples_per_s", "step_s", "mfu", "step_cv",
                                     "host_bound_fraction", "peak_mem_gib_rank0")}, flush=True)
            runs.append(r)
            rows.append(r)
            dump()
        if runs:
            s = summarize(runs)
            print("SUMMARY " + json.dumps(s), flush=True)
            summaries.append(s)
            dump()
    if rows:
        write(kv, rows, summaries, argv)
    if failures:
        sys.exit(f"{len(failures)} run(s) failed: " + ", ".join(f"nproc={f['nproc']} run {f['run']}"
                                                                  for f in failures))


def write(kv, rows, summaries, argv):
    out = Path(kv["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    r0 = rows[0]
    dev = r0["device"]
    h = r0["host"]
    machine = ((f"{r0['gpu_name']}, " if dev == "cuda" else "")
               + f"{h.get('cpu_model', '?')}, {h['cpu_count']} CPU cores")
    lines = [f"\n## {kv['policy']} {kv['size']} on {dev} ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')})", "",
             f"- command: `python bench/bench_train.py {' '.join(argv)}`",
             f"- machine: {machine}; torch {r0['torch']}; load average {os.getloadavg()[0]:.1f} at the end",
             f"- OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} per rank; data={kv['data']}; "
             f"{kv['runs']} run(s) x {kv['steps']} measured steps after {kv['warmup']} warm-up",
             "- timed: trainer step (sft_loss fwd+bwd, clip, AdamW); a run's figure is its median step; FLOPs "
             "measured with FlopCounterMode (fwd+bwd of the global batch); MFU vs "
             f"{kv['peak_tflops']} TFLOP/s per GPU" + (f"; {kv['note']}" if kv["note"] else ""), "",
             "| ranks | run | shard | precision | act. ckpt | compile | reshard | params (trainable) | "
             "batch (micro x accum) | median step s | samples/s | TFLOP/step | TFLOP/s | MFU | step CV | host/step | "
             "data wait s | peak mem GiB | first step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"| {r['nproc']} | {r['run']} | {r['shard']} | {r['precision']} | {r['ac']} | {r['compile']} | "
                     f"{r['reshard_after_forward'] if r['shard'] == 'fsdp' else '-'} | "
                     f"{r['params_M']:.2f}M ({r['trainable_M']:.2f}M) | {r['global_batch']} ({r['micro_batch']} x "
                     f"{r['grad_accum']}) | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | {r['tflop_per_step']:.4f} | "
                     f"{r['achieved_tflops']:.3f} | {mfu} | {r['step_cv']:.3f} | {r['host_bound_fraction']:.2f} | "
                     f"{r['median']['data_wait_s']:.4f} | {r['peak_mem_gib_rank0']:.2f} | {r['first_step_s']:.1f} |")
    lines.append("")
    for s in summaries:
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else ""
        extra = ""
        if s.get("per_run_median_sm_clock_mhz"):
            extra += f"; median SM clock per run {s['per_run_median_sm_clock_mhz']} MHz"
        if "per_run_alloc_retries" in s:
            extra += (f"; allocator retries per run {s['per_run_alloc_retries']}, cudaMallocs while measuring "
                      f"{s['per_run_cuda_mallocs']}")
        lines.append(f"- {s['nproc']} rank(s): median of {s['runs']} run(s) {s['samples_per_s']:.1f} samples/s{mfu}; "
                     f"spread between runs {100 * s['spread']:.1f}%{extra}")
    if not out.exists():
        out.write_text("# Training throughput (bench/bench_train.py)\n")
    with open(out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
