"""Markdown tables from the JSON files bench/device/run_all.sh leaves under $OUT.

    python bench/device/report.py DIR      # DIR holds nano.json, sft.json, eval_*.json (any subset)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def nano(d: dict) -> list[str]:
    c, m = d["ceilings"], d["model"]
    f = m["flops"]
    sus = c.get("bf16_matmul_tflops_sustained")
    clk = c.get("bf16_matmul_clock_sustained") or {}
    sus_txt = (f" (burst); sustained for {c['bf16_matmul_sustained_s']:.0f} s {sus:.0f} TFLOP/s"
               + (f" at {clk['sm_mhz']:.0f} MHz, {clk['power_w']:.0f} W of {clk['power_limit_w']:.0f} W" if clk else "")
               if sus else "")
    rounds = c.get("bf16_matmul_tflops_rounds") or []
    best = f" (the best of {', '.join(f'{r:.0f}' for r in rounds)})" if len(rounds) > 1 else ""
    out = [f"Ceilings measured in the same call: bf16 matmul 8192^3 {c['bf16_matmul_tflops']:.0f} TFLOP/s{best}"
           f"{sus_txt}, "
           f"device copy {c['copy_tb_s']:.2f} TB/s (read + write).",
           f"Model: {m['params']['total'] / 1e9:.2f}B parameters (understanding {m['params']['und'] / 1e9:.2f}B, "
           f"generation {m['params']['gen'] / 1e9:.2f}B), prefix {m['prefix_len']} tokens, "
           f"{f['total'] / 1e12:.2f} TFLOP per observation (vision {f['vision'] / 1e12:.2f}, prefix "
           f"{f['und_prefix'] / 1e12:.2f}, {f['steps']} x {f['gen_per_step'] / 1e12:.3f} denoising); "
           f"memory floor {m['floor_gen_ms']:.0f} ms (generation weights once per step) / {m['floor_all_ms']:.0f} ms "
           f"(+ understanding weights once); compute roofline {m['roofline_obs_s']:.1f} obs/s; "
           f"built in {d.get('build_s', 0):.0f} s.", "",
           "| mode | batch | p50 ms | p99 ms | obs/s | TFLOP/s | of burst ceiling | of sustained | SM MHz at end | "
           "x floor | prep ms | prefix ms (vision) | loop ms | first call ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d.get("predict", []):
        if "error" in r:
            out.append(f"| {r['mode']} | {r['batch']} | failed: {r['error'][:80]} |||||||||||")
            continue
        of_sus = f"{100 * r['of_sustained_ceiling']:.0f}%" if r.get("of_sustained_ceiling") else "-"
        mhz = f"{r['clock_end']['sm_mhz']:.0f}" if r.get("clock_end") else "-"
        out.append(f"| {r['mode']} | {r['batch']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['obs_s']:.1f} | "
                   f"{r['tflops']:.0f} | {100 * r['mfu']:.0f}% | {of_sus} | {mhz} | {r['p50_ms'] / m['floor_gen_ms']:.2f} | "
                   f"{r['prep_ms']:.1f} | {r['prefix_ms']:.1f} ({r.get('vision_ms', float('nan')):.1f}) | "
                   f"{r['loop_ms']:.1f} | {r['first_call_ms']:.0f} |")
    for mode, w in d.get("warmup", {}).items():
        if "error" in w:
            out.append(f"\nWarm-up of {mode} failed: {w['error'][:300]}")
        else:
            out.append(f"\nWarm-up of {mode} (every CUDA-graph bucket, before timing): {w['total_s']:.1f} s "
                       f"({', '.join(f'b={k}: {v:.1f} s' for k, v in w['per_bucket_s'].items())})")
    if d.get("http"):
        out += ["", "HTTP (`wamkit serve`, cuda_graphs=true; C client loops, one observation per request):", "",
                "| servers | concurrency | obs/s | p50 ms | p99 ms | mean batch |", "|---|---|---|---|---|---|"]
        for r in d["http"]:
            out.append(f"| {r['servers']} | {r['concurrency']} | {r['obs_s']:.1f} | {r['p50_ms']:.0f} | "
                       f"{r['p99_ms']:.0f} | {r['mean_batch']:.1f} |")
    if d.get("http_error"):
        out.append(f"\nHTTP failed: {d['http_error']}")
    return out


def sft(d: dict) -> list[str]:
    out = ["| ranks | size | trainable | act. ckpt | compile | AdamW | params (trainable) | global batch | step s | "
           "samples/s | TFLOP/step | TFLOP/s | MFU vs 989 | peak mem GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['nproc']} | {r.get('size')} | {r.get('trainable')} | {r.get('ac')} | {r.get('compile', False)} "
                   f"| {r.get('optimizer', 'foreach')} | {r['params_M'] / 1e3:.2f}B "
                   f"({r['trainable_M'] / 1e3:.2f}B) | {r['global_batch']} | {r['step_s']:.3f} | "
                   f"{r['samples_per_s']:.1f} | {r['tflop_per_step']:.1f} | {r['achieved_tflops']:.0f} | "
                   f"{100 * r['mfu']:.1f}% | {r['peak_mem_gib_rank0']:.1f} |")
    for s in d.get("summary", []):   # bench_train's runs of one command: median over runs and their spread
        out.append(f"\n{s['nproc']} rank(s), {s['runs']} runs: median {s['samples_per_s']:.1f} samples/s "
                   f"(MFU {100 * s['mfu']:.1f}%), runs {', '.join(f'{x:.1f}' for x in s['per_run_samples_per_s'])}, "
                   f"spread {100 * s['spread']:.1f}%")
    return out


def evalb(d: dict) -> list[str]:
    from wamkit.eval.bench import markdown

    p = d["plan"]
    return [f"plan: {p['env']} tasks {p['tasks']} x {p['trials']} trials, {p['num_envs']} envs, max_steps "
            f"{p['max_steps']}, policy {p['policy']} {p['policy_args']}", "", markdown(d)]


def contention(d: dict) -> list[str]:
    out = [f"MuJoCo: MUJOCO_GL={d.get('MUJOCO_GL')}, load render_quality={d.get('render_quality', 'model')}; policy "
           f"{d['policy_args']}; {d['cores']} cores.", "",
           "| beside the server | torch threads | batch | request ms | server compute ms (p90) | in-process prefix ms "
           "| in-process loop ms | load env steps/s | GPU util % | SM MHz |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['scenario']} | {r['torch_threads']} | {r['batch']} | {r['request_ms']} | {r['compute_ms']} "
                   f"({r['compute_p90_ms']}) | {r.get('split_prefix_ms', '-')} | {r.get('split_loop_ms', '-')} | "
                   f"{r['load_steps_s']} | {r.get('gpu_util', '-')} | {r.get('sm_clock_mhz', '-')} |")
    return out


def main(argv) -> int:
    root = Path(argv[0])
    if (root / "nano.json").exists():
        print("### nano.json\n")
        print("\n".join(nano(json.loads((root / "nano.json").read_text()))) + "\n")
    for p in sorted(root.glob("sft*.json")):
        print(f"### {p.name}\n")
        print("\n".join(sft(json.loads(p.read_text()))) + "\n")
        for r in json.loads(p.read_text())["rows"]:
            if r.get("profile"):
                print("```\n" + r["profile"] + "\n```\n")
    if (root / "contention.json").exists():
        print("### contention.json\n")
        print("\n".join(contention(json.loads((root / "contention.json").read_text()))) + "\n")
    for p in sorted(root.glob("eval_*.json")):
        print(f"### {p.name}\n")
        print("\n".join(evalb(json.loads(p.read_text()))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
