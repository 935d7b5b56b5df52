#!/usr/bin/env bash
# #19: does CUDA-graph padding slow the evaluation's server? One call, 16 envs x 400 MetaWorld episodes (8 tasks),
# the same rows twice: A with wam-ref's graph buckets until session 26 (1, 2, 4, 8, 16: a merged batch of 9-15 runs
# the 16 graph), B with a graph at every size 1..16 (no padding); then bench_buckets.py (the model's cost at every size,
# alone) with what time is left. Each invocation starts its own server (the rows of one share it).
#   OUT=... bash bench/device/eval_buckets_ab.sh [ROWS_A] [ROWS_B]
set -u
O=${OUT:?}
A_ROWS=${1:-"B=8, P=2;auto"}; B_ROWS=${2:-"B=8, P=2;B=1, P=16;auto"}
ARGS="env_args.render_quality=fast rounds=2 max_steps=500 policy_args.compile=true"
EVERY=$(seq -s, 1 16)
mkdir -p "$O/default" "$O/every" "$O/buckets"
OUT=$O/default EVAL_NTASKS=8 EVAL_T=${A_T:-250} EVAL_ROWS="$A_ROWS" bash bench/device/run_all.sh scale=full parts=eval \
  evalscales=16x400 eval_args="$ARGS bound=contended policy_args.graph_buckets=1,2,4,8,16" > /dev/null 2>&1
OUT=$O/every EVAL_NTASKS=8 EVAL_T=${B_T:-230} EVAL_ROWS="$B_ROWS" bash bench/device/run_all.sh scale=full parts=eval \
  evalscales=16x400 eval_args="$ARGS bound=false policy_args.graph_buckets=$EVERY" > /dev/null 2>&1
PYTHONPATH=/tmp/site:$PWD/src timeout -k 5 "${C_T:-90}" python3 bench/device/bench_buckets.py \
  --out "$O/buckets/buckets.json" --max-batch 16 --reps 10 > "$O/buckets/log.txt" 2>&1
for d in default every; do echo "== $d"; grep -v "^\s*$" "$O/$d/run_all.log" | tail -n 25; done
tail -n 20 "$O/buckets/log.txt"
