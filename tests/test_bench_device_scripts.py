"""The device benches' host-side logic on the CPU: bench_attention.py's rows (every layout and padding gives the
same attention as the reference, K/V bytes per layout) and bench_nano.py's kernel classification (the profile's
"where each millisecond goes")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "device" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_attention_rows_agree_across_layouts_and_padding(tmp_path):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, str(ROOT / "bench" / "device" / "bench_attention.py"), "--out", str(out), "--device",
           "cpu", "--dtype", "float32", "--size", "tiny", "--batches", "1,3", "--pads", "0,5", "--backends",
           "auto,math", "--reps", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    sh = d["shapes"]
    assert sh["heads"] > sh["kv_heads"] and sh["prefix"] > 0 and sh["tokens"] > 0   # tiny has GQA
    rows = d["rows"]
    assert len(rows) == 2 * 3 * 2 * 2 and not [r for r in rows if "error" in r]
    for r in rows:
        assert r["max_abs_diff"] < 1e-5, r             # same attention whatever the layout, padding, backend
        assert r["keys"] == sh["prefix"] + r["pad"] + sh["tokens"] and r["us_per_call"] > 0
    by = {(r["batch"], r["layout"], r["pad"], r["backend"]): r for r in rows}
    ratio = sh["heads"] // sh["kv_heads"]
    for layout in ("room", "folded"):
        assert abs(by[(3, "expanded", 0, "auto")]["kv_mb_per_call"]
                   - ratio * by[(3, layout, 0, "auto")]["kv_mb_per_call"]) < 1e-9


def test_bench_lanes_drives_every_lane_and_reports_each_combination(tmp_path):
    """bench_lanes.py on the CPU (tiny): one row per (batch, lanes); with 2 lanes both the policy and its replica
    ran calls, the observation rate is calls x batch over the row's wall time, one lane is its own baseline."""
    out = tmp_path / "lanes.json"
    cmd = [sys.executable, str(ROOT / "bench" / "device" / "bench_lanes.py"), "--out", str(out), "--device", "cpu",
           "--size", "tiny", "--batches", "1,2", "--lanes", "1,2", "--seconds", "0.3", "--steps", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["lanes"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in rows:
        assert len(r["calls_per_lane"]) == r["lanes"] and all(c >= 1 for c in r["calls_per_lane"])
        assert r["calls"] == sum(r["calls_per_lane"])
        assert abs(r["obs_per_s"] - r["batch"] * r["calls"] / r["wall_s"]) < 0.05 * r["obs_per_s"] + 0.01
        if r["lanes"] == 1:
            assert r["speedup"] == 1.0


def test_bench_nano_kernel_kinds():
    nano = _load("bench_nano")
    assert nano.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x128") \
        == "attention"
    assert nano.kernel_kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert nano.kernel_kind("nvjet_sm90_tst_192x16_64x8_2x1_v_bz_TNT") == "gemm"
    assert nano.kernel_kind("_skinny_kernel") == "gemm"
    assert nano.kernel_kind("triton_red_fused__fused_rms_norm_add_mul_0") == "norm/elementwise"
    assert nano.kernel_kind("Memset (Unknown)") == "copy"


def test_bench_nano_kernel_time_split_by_phase():
    """Each kernel's device time goes to the phase range holding its midpoint, by kind; kernels outside every
    range are kept apart (not dropped), and the phase ranges themselves are not kernels."""
    nano = _load("bench_nano")
    spans = [("prefix", 0.0, 1000.0), ("denoise", 1000.0, 5000.0)]
    kernels = [("nvjet_sm90_tst_256x128", 10.0, 510.0), ("triton_red_fused__fused_rms_norm_0", 600.0, 700.0),
               ("nvjet_sm90_tst_192x128", 990.0, 1210.0),          # straddles: midpoint 1100 is in denoise
               ("cudnn_generated_fort_native_sdpa_sm90_flash", 2000.0, 2040.0), ("Memset (Unknown)", 6000.0, 6002.0)]
    got = nano.kinds_by_phase(spans, kernels)
    assert got == {"prefix": {"gemm": 0.5, "norm/elementwise": 0.1},
                   "denoise": {"attention": 0.04, "gemm": 0.22}, "outside": {"copy": 0.002}}

    class Ev:   # torch.profiler's raw events: host-side ones and the phase annotations are not kernels
        def __init__(self, name, device, t0, t1, annotation=False):
            self.name, self.device_type, self.is_user_annotation = name, device, annotation
            self.time_range = type("TR", (), {"start": t0, "end": t1})()

    raw = [Ev("wamkit.prefix", "DeviceType.CUDA", 0.0, 1000.0, True), Ev("aten::mm", "DeviceType.CPU", 5.0, 9.0),
           Ev("nvjet_sm90_tst_256x128", "DeviceType.CUDA", 10.0, 510.0)]
    assert nano._device_spans(raw) == ([("prefix", 0.0, 1000.0)], [("nvjet_sm90_tst_256x128", 10.0, 510.0)])



def test_bench_nano_lists_the_loops_kernels_per_block_and_step():
    """The denoising loop's kernels launched at least once per block and step (2 blocks x 3 steps here), with
    launches per block-step and time per launch; the prefix's kernels and the loop's rarer ones are left out."""
    nano = _load("bench_nano")
    spans = [("prefix", 0.0, 100.0), ("denoise", 100.0, 1000.0)]
    kernels = ([("gemm_a", 10.0, 60.0)]                                           # the prefix's
               + [("gemm_b", 100.0 + 20 * i, 110.0 + 20 * i) for i in range(12)]  # twice per block-step, 10 us
               + [("copy_q", 400.0 + 10 * i, 404.0 + 10 * i) for i in range(6)]   # once, 4 us
               + [("final_norm", 900.0, 950.0)])                                  # once per call
    got = nano.block_step_kernels(spans, kernels, 2 * 3)
    assert got == [{"kernel": "gemm_b", "per_block_step": 2.0, "us": 10.0, "ms": 0.12},
                   {"kernel": "copy_q", "per_block_step": 1.0, "us": 4.0, "ms": 0.024}]
    assert nano.block_step_kernels([("prefix", 0.0, 100.0)], kernels, 6) == []


def test_bench_lanes_runs_the_eval_rows_policy():
    """bench_lanes.py's lanes are the eval server's policy (eval_metaworld.yaml's policy_args, CUDA graphs on), not a
    copy of it: session 15's copy lacked cuda_graphs and timed eager calls the eval never makes."""
    import argparse

    import yaml

    lanes = _load("bench_lanes")
    a = argparse.Namespace(size="small", device="cuda", dtype="bfloat16", steps=10, compile=True)
    kw = lanes.lane_policy_args(a, [1, 8, 16])
    eval_args = yaml.safe_load((ROOT / "bench" / "device" / "eval_metaworld.yaml").read_text())["policy_args"]
    assert kw["cuda_graphs"] is True and eval_args["cuda_graphs"] is True
    assert {k: kw[k] for k in eval_args if k not in ("size", "device", "dtype", "num_inference_steps")} == \
        {k: v for k, v in eval_args.items() if k not in ("size", "device", "dtype", "num_inference_steps")}
    assert kw["graph_buckets"] == "1,8,16" and kw["max_batch_size"] == 16 and kw["compile"] is True


def test_run_all_refuses_an_unknown_part(tmp_path):
    """A part run_all does not know ran nothing and said nothing (session 15 spent a device call on parts=gemm
    before gemm was a part): it now stops at once, naming the part and the ones it knows, before any setup."""
    p = subprocess.run(["bash", str(ROOT / "bench" / "device" / "run_all.sh"), "parts=nano,gemmm"],
                       capture_output=True, text=True, timeout=30, cwd=ROOT, env={"PATH": "/usr/bin:/bin",
                                                                                  "OUT": str(tmp_path)})
    assert p.returncode == 2
    assert "unknown part 'gemmm'" in p.stdout and "lanes,gemm" in p.stdout
    assert not (tmp_path / "run_all.log").exists()   # stopped before setup wrote anything


def test_bench_nano_cpu_smoke_with_the_autotune_gemms_and_no_profile(tmp_path):
    """bench_nano on the CPU (tiny, one batch): gemm=autotune reaches the policy and its actions match the eager
    reference; `--profile 0` (as session 15's commands wrote it) profiles nothing instead of failing at batch 0."""
    out = tmp_path / "nano.json"
    cmd = [sys.executable, str(ROOT / "bench" / "device" / "bench_nano.py"), "--out", str(out), "--device", "cpu",
           "--size", "tiny", "--dtype", "float32", "--batches", "2", "--modes", "eager:folded", "--reps", "1",
           "--http=", "--profile", "0", "--check", "2", "--steps", "2", "--policy-arg", "gemm=autotune"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "FAILED" not in p.stdout + p.stderr
    d = json.loads(out.read_text())
    assert d["profile"] == {} and [r["batch"] for r in d["predict"]] == [2]
    assert d["check"]["gemm"] == "autotune" and d["check"]["batches"]["2"]["max_abs_diff"] < 1e-4


def test_bench_buckets_prices_each_size_at_its_default_bucket(tmp_path):
    """bench_buckets on the CPU (tiny, no graphs): every size 1..max is timed on its own, and each size's cost with the
    default buckets is the time of the next bucket up (graph_buckets(None, 5) = 1, 2, 4, 5: size 3 runs at 4's)."""
    out = tmp_path / "buckets.json"
    cmd = [sys.executable, str(ROOT / "bench" / "device" / "bench_buckets.py"), "--out", str(out), "--device", "cpu",
           "--max-batch", "5", "--reps", "1", "--compile", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    rows = {r["n"]: r for r in d["rows"]}
    assert sorted(rows) == [1, 2, 3, 4, 5] and d["default_buckets"] == [1, 2, 4, 5]
    assert [rows[n]["default_bucket"] for n in range(1, 6)] == [1, 2, 4, 4, 5]
    assert rows[3]["ms_default_bucket"] == rows[4]["ms"]
    assert abs(rows[3]["padding_cost"] - rows[4]["ms"] / rows[3]["ms"]) < 2e-3 and rows[2]["padding_cost"] == 1.0
