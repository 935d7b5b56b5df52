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


def test_bench_nano_kernel_kinds():
    nano = _load("bench_nano")
    assert nano.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x128") \
        == "attention"
    assert nano.kernel_kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert nano.kernel_kind("nvjet_sm90_tst_192x16_64x8_2x1_v_bz_TNT") == "gemm"
    assert nano.kernel_kind("_skinny_kernel") == "gemm"
    assert nano.kernel_kind("triton_red_fused__fused_rms_norm_add_mul_0") == "norm/elementwise"
    assert nano.kernel_kind("Memset (Unknown)") == "copy"
