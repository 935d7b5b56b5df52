#!/usr/bin/env bash
# LIBERO on the GPU machine (issue 19 item 4): the scheduler table with wam-ref small behind `wamkit serve` on the
# GPU, the envs rendering through EGL. Needs the slim LIBERO bundle unpacked (bench/device/setup_libero_slim.sh: two
# calls on one warm machine, see there) and .gl + .whl-libero (or .whl-lite) carried.
#
#   bash bench/device/run_libero.sh [envs=16[,32]] [rows="single-batch;B=16, P=1;..."] [rounds=1] [row_s=35] [max_steps=160]
#        [bound=true] [probe=true] [tag=...]
#
# probe: one LiberoEnv builds, resets and runs chunks first; its ms per step sizes the rows (each row aims at ~row_s
# seconds: more trials for fast rows), and is printed. single-batch (every step rendered, one env) runs as its own
# `bench eval` with its own trial count (it is ~10x slower); its env steps/s is the ratios' denominator.
# envs=16,32: one table per env count (single-batch once); env ROWS2 / BOUND2: rows and bound of the later ones.
set -u
MS_STEP0=""; MS_RSTEP0=""; ENVS=16; ROWS=""; ROUNDS=1; ROW_S=35; MAX_STEPS=160; BOUND=true; PROBE=true; TAG=""; EXTRA=""
for a in "$@"; do
  case "$a" in
    envs=*) ENVS=${a#*=};; rows=*) ROWS=${a#*=};; rounds=*) ROUNDS=${a#*=};; row_s=*) ROW_S=${a#*=};;
    max_steps=*) MAX_STEPS=${a#*=};; bound=*) BOUND=${a#*=};; probe=*) PROBE=${a#*=};; tag=*) TAG=${a#*=};;
    extra=*) EXTRA=${a#*=};; ms_step=*) MS_STEP0=${a#*=};; ms_rstep=*) MS_RSTEP0=${a#*=};;
    *) echo "unknown argument $a"; exit 2;;
  esac
done
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_libero.log") 2>&1
export PYTHONUNBUFFERED=1 MUJOCO_GL=egl PYOPENGL_PLATFORM=egl
T0=$(date +%s)
echo "=== run_libero $* ($(date -u +%FT%TZ))"
if [ -d .gl ]; then for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig; fi
WHL=.whl-lite; [ -d .whl-libero ] && WHL=.whl-libero   # .whl-libero: .whl-lite without metaworld (fetch_libero_slim.sh)
if [ -d $WHL ] && [ ! -f /tmp/site/.wamkit-lite ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
    && touch /tmp/site/.wamkit-lite
fi
export PYTHONPATH=/tmp/site:$PWD/src
source bench/device/setup_libero_slim.sh || { echo "libero-slim not ready"; exit 3; }
echo "setup done after $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,power.draw --format=csv -lms 500 > "$OUT/gpu_samples${TAG}.csv" 2>/dev/null &
SMI=$!; trap 'kill $SMI 2>/dev/null' EXIT
NT=4   # tasks 0-3 of libero_10
MS_STEP=${MS_STEP0:-20}; MS_RSTEP=${MS_RSTEP0:-25}   # probe=false: ms_step= / ms_rstep= (an earlier probe's figures)
if [ "$PROBE" = true ]; then
  python3 - "$OUT/probe.json" <<'PYEOF'
import json, sys, time
import numpy as np
from wamkit.envs.libero import LiberoEnv
t0 = time.perf_counter(); env = LiberoEnv("libero_10"); build = time.perf_counter() - t0
res = {"build_s": build}
for task in (0, 1):
    t0 = time.perf_counter(); obs = env.reset(task, 0); res[f"reset_{task}_s"] = time.perf_counter() - t0
    a = np.zeros((16, 7), np.float32)
    env.execute(a)
    t0 = time.perf_counter()
    for _ in range(4):
        r = env.execute(a, run_to_max_steps=True)
    res[f"ms_per_step_{task}"] = (time.perf_counter() - t0) / 64 * 1e3
    t0 = time.perf_counter()
    for _ in range(2):
        r = env.execute(a, render_every_step=True, run_to_max_steps=True)
    res[f"ms_per_rendered_step_{task}"] = (time.perf_counter() - t0) / 32 * 1e3
    res[f"image_mean_{task}"] = float(np.mean(r.obs.images["image"]))
res["ms_per_step"] = float(np.mean([res["ms_per_step_0"], res["ms_per_step_1"]]))
res["ms_per_rendered_step"] = float(np.mean([res["ms_per_rendered_step_0"], res["ms_per_rendered_step_1"]]))
print("probe", json.dumps(res))
json.dump(res, open(sys.argv[1], "w"), indent=1)
PYEOF
  MS_STEP=$(python3 -c "import json; print(json.load(open('$OUT/probe.json'))['ms_per_step'])" 2>/dev/null || echo 20)
  MS_RSTEP=$(python3 -c "import json; print(json.load(open('$OUT/probe.json'))['ms_per_rendered_step'])" 2>/dev/null || echo 25)
  echo "=== probe done at +$(( $(date +%s) - T0 )) s: $MS_STEP ms/step, $MS_RSTEP ms/rendered step"
fi
SB_DONE=0
for E in ${ENVS//,/ }; do
# trials per task so that a row lasts ~ROW_S s (rounded to whole waves of envs): pipelined rows at ~60% of
# min(envs, 16 cores) x the probe's rate;
# single-batch at one env, every step rendered, plus ~40 ms of inference per 16-step chunk
read TRIALS SB_TRIALS < <(python3 -c "
import math
e, ms, rms, row, mx, nt = $E, $MS_STEP, $MS_RSTEP, $ROW_S, $MAX_STEPS, $NT
par = 0.6 * min(e, 16) * 1000 / ms
t = max(math.ceil(2 * e / nt), math.ceil(row * par / mx / nt))
w = e // math.gcd(e, nt)           # whole waves: episodes a multiple of the envs (68 on 32 envs left 4 alone at the end)
t = max(w, round(t / w) * w)
sb = 1000 / (rms + 40 / 16)
print(min(t, 50 // w * w or w), max(1, math.ceil(row * sb / mx / nt)))")
echo "=== rows: $E envs, $(( TRIALS * NT )) episodes x $MAX_STEPS steps; single-batch: $(( SB_TRIALS * NT )) episodes"
BASE=(bench/device/eval_libero.yaml num_envs="$E" max_steps="$MAX_STEPS")
R="$ROWS"; [ -z "$R" ] && R="single-batch;B=$E, P=1;B=4, P=$(( E / 4 ));B=1, P=$E;auto"
OTHER=$(echo "$R" | tr ';' '\n' | grep -v '^single-batch$' | paste -sd';')
if [ $SB_DONE = 0 ] && echo "$R" | tr ';' '\n' | grep -qx single-batch; then
  timeout -k 10 ${SB_T:-150} python3 -m wamkit.cli.main bench eval "${BASE[@]}" trials="$SB_TRIALS" rows="single-batch" \
    bound=false out="/tmp/lib_sb$TAG" $EXTRA
  echo "=== single-batch rc=$? at +$(( $(date +%s) - T0 )) s"
  cp /tmp/lib_sb$TAG/bench_eval.json "$OUT/libero_single_batch$TAG.json" 2>/dev/null
  SB_DONE=1
fi
if [ -n "$OTHER" ]; then
  timeout -k 10 ${ROWS_T:-420} python3 -m wamkit.cli.main bench eval "${BASE[@]}" trials="$TRIALS" rows="$OTHER" \
    rounds="$ROUNDS" bound="$BOUND" deadline_s=$(( ${ROWS_T:-420} - 15 )) out="/tmp/lib_${E}$TAG" $EXTRA
  echo "=== rows ($E envs) rc=$? at +$(( $(date +%s) - T0 )) s"
  cp /tmp/lib_${E}$TAG/bench_eval.json "$OUT/libero_${E}envs$TAG.json" 2>/dev/null \
    || cp /tmp/lib_${E}$TAG/bench_eval.partial.json "$OUT/libero_${E}envs${TAG}_partial.json" 2>/dev/null
  for d in /tmp/lib_${E}$TAG/*/; do
    n=$(basename "$d"); [ -f "$d/timeline.png" ] && cp "$d/timeline.png" "$OUT/timeline_${E}_${n}$TAG.png"
    for r in "$d"/round*/; do   # every round's (rows are compared round by round: bench_eval.json *_rounds)
      [ -f "$r/timeline.png" ] && cp "$r/timeline.png" "$OUT/timeline_${E}_${n}_$(basename "$r")$TAG.png"
    done
  done
  # each episode's actions digest and env time, per row and round: equal digests, equal trajectories, so two rows'
  # (or rounds') env cost per chunk compare over the same physics (since session 34: was auto's excess its own?)
  python3 - "/tmp/lib_${E}$TAG" "$OUT/episodes_${E}envs$TAG.json" <<'PYEOF'
import json, pathlib, sys
root, out = pathlib.Path(sys.argv[1]), {}
for f in sorted(root.glob("*/round*/results.jsonl")) + sorted(root.glob("*/results.jsonl")):
    eps = {}
    for line in f.read_text().splitlines():
        r = json.loads(line)
        eps[r["key"]] = [r["actions_digest"][:16], r["sim_s"], r["chunks"], r["env_index"]]
    out[str(f.parent.relative_to(root))] = eps
pathlib.Path(sys.argv[2]).write_text(json.dumps(out))
print(f"episodes: {len(out)} runs -> {sys.argv[2]}")
PYEOF
fi
ROWS=""; BOUND=${BOUND2:-$BOUND}
[ -n "${ROWS2:-}" ] && ROWS="$ROWS2"
done
echo "=== all done after $(( $(date +%s) - T0 )) s"
