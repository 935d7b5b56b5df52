#!/usr/bin/env bash
# Every GPU measurement of issue 9 in one call on the device machine (see bench/results/gpu.md).
#
#   bash bench/device/run_all.sh [scale=smoke|full] [parts=nano,eval,sft,contention,attn,lanes,gemm] [ngpu=1]
#        [evalscales=8x32,16x64] [sft_variants="activation_checkpointing=true;activation_checkpointing=false compile=true"]
#        [nano_args=...] [attn_args=...] [lanes_args=...] [gemm_args=...]
#        [gl=egl|osmesa|auto] [eval_args="env_args.render_quality=fast ..."] [cont_args=...]
#
# Installs the carried GL loaders (.gl) and wheels (.whl), then runs each part under its own time limit and keeps
# going when one fails. Everything lands under $OUT (run_all.log = the whole console; one JSON per part).
# ngpu=N: SFT under torchrun nproc=N (global batch N x 64), N action servers (one per GPU) for the HTTP rows, and
# the evaluation rows once with one server and once with N (server.replicas=N server.gpus=0..N-1).
set -u
SCALE=smoke; PARTS=nano,eval,sft; CONT_ARGS=""; GL=egl; EVAL_ARGS=""; SFT_TRAIN=all; NGPU=1; EVALSCALES=""; NANO_ARGS=""; SFT_VARIANTS=""; ATTN_ARGS=""; LANES_ARGS=""; GEMM_ARGS=""
for a in "$@"; do
  case "$a" in
    scale=*) SCALE=${a#*=};; parts=*) PARTS=${a#*=};; ngpu=*) NGPU=${a#*=};; evalscales=*) EVALSCALES=${a#*=};;
    nano_args=*) NANO_ARGS=${a#*=};; attn_args=*) ATTN_ARGS=${a#*=};; lanes_args=*) LANES_ARGS=${a#*=};; gemm_args=*) GEMM_ARGS=${a#*=};; cont_args=*) CONT_ARGS=${a#*=};; gl=*) GL=${a#*=};; eval_args=*) EVAL_ARGS=${a#*=};; sft_trainable=*) SFT_TRAIN=${a#*=};; sft_variants=*) SFT_VARIANTS=${a#*=};;
    *) echo "unknown argument $a"; exit 2;;
  esac
done
# a part that is not one of these ran nothing and said nothing (session 15 lost a call to parts=gemm): refuse it
KNOWN_PARTS=nano,eval,sft,contention,attn,lanes,gemm
for p in ${PARTS//,/ }; do
  case ",$KNOWN_PARTS," in *",$p,"*) ;; *) echo "run_all: unknown part '$p' (parts: $KNOWN_PARTS)"; exit 2;; esac
done
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/run_all.log
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 MUJOCO_GL=egl PYOPENGL_PLATFORM=egl NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
echo "=== run_all $* ($(date -u +%FT%TZ)) scale=$SCALE parts=$PARTS ngpu=$NGPU"
T0=$(date +%s)
if [ -d .gl ]; then for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig; fi
WHL=.whl; [ -d .whl ] || WHL=.whl-lite   # .whl-lite: metaworld slimmed (fetch_osmesa.sh): room for .mesa in one call
if [ -d $WHL ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
    || echo "WARNING: wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
# gl=osmesa: MuJoCo on the CPU (Mesa llvmpipe) instead of EGL on the GPU; see setup_osmesa.sh
[ "$GL" = osmesa ] && . bench/device/setup_osmesa.sh
[ "$GL" = auto ] && . bench/device/setup_osmesa.sh   # OSMesa loadable, MUJOCO_GL unset: render_backend=auto chooses
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
python3 bench/device/gl_check.py 2>&1 | grep gl_check || echo "gl_check: MuJoCo not importable here"
echo "setup done after $(( $(date +%s) - T0 )) s"
# GPU clock, utilization and power every 500 ms for the whole call (which part ran when: the stamps in run_all.log)
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,power.draw --format=csv -lms 500 > "$OUT/gpu_samples.csv" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT

part() { case ",$PARTS," in *",$1,"*) return 0;; *) return 1;; esac; }
stamp() { echo "=== $1 done (rc=$2) at +$(( $(date +%s) - T0 )) s ($(date -u +%T))"; }

if [ "$SCALE" = smoke ]; then
  NANO="--batches 1,64 --modes eager,graphs,graphs+compile --reps 2 --profile 64 --http 1,8 --http-seconds 3"
  NANO_T=200; EVAL_T=150; SFT_T=150; SFT="batch=16 steps=2 warmup=1 runs=1"
  [ -z "$EVALSCALES" ] && EVALSCALES="2x4"; EVAL_STEPS=40; EVAL_ROWS="single-batch;auto"
else
  NANO="--batches 1,2,4,8,16,32,64 --modes eager,graphs,graphs+compile --reps 4 --profile 64 --http 1,16,64 --http-seconds 8"
  # SFT: 3 runs (separate processes) x 20 measured steps after 3 warm-up, per variant (~1 min per run for 1b)
  NANO_T=${NANO_T:-420}; EVAL_T=${EVAL_T:-220}; SFT_T=${SFT_T:-240}; SFT="batch=64 steps=20 warmup=3 runs=3"
  [ -z "$EVALSCALES" ] && EVALSCALES="8x32"; EVAL_STEPS=100; EVAL_ROWS=${EVAL_ROWS:-}
fi
[ -n "$NANO_ARGS" ] && NANO="$NANO $NANO_ARGS"

if part nano; then
  echo "=== nano: bench/device/bench_nano.py $NANO --ngpu $NGPU"
  timeout -k 10 $NANO_T python3 bench/device/bench_nano.py --out "$OUT/nano.json" --ngpu "$NGPU" $NANO
  stamp nano $?
fi

if part attn; then   # the denoising loop's attention alone: K/V layouts x key padding x SDPA backends
  echo "=== attn: bench/device/bench_attention.py $ATTN_ARGS"
  timeout -k 10 ${ATTN_T:-120} python3 bench/device/bench_attention.py --out "$OUT/attention.json" $ATTN_ARGS
  stamp attn $?
fi

if part lanes; then   # wam-ref predict from 1..N lanes at once (the server's concurrent_batches), no HTTP
  echo "=== lanes: bench/device/bench_lanes.py $LANES_ARGS"
  timeout -k 10 ${LANES_T:-150} python3 bench/device/bench_lanes.py --out "$OUT/lanes.json" $LANES_ARGS
  stamp lanes $?
fi

if part gemm; then   # the denoising loop's GEMM shapes: cuBLAS / Triton / autotune at 16 and 1024 rows
  echo "=== gemm: bench/device/bench_gemm.py --budget-s ${GEMM_BUDGET:-78} $GEMM_ARGS"
  timeout -k 10 $(( ${GEMM_BUDGET:-78} + 20 )) python3 bench/device/bench_gemm.py --out "$OUT/gemm.json" \
    --budget-s "${GEMM_BUDGET:-78}" $GEMM_ARGS
  stamp gemm $?
fi

if part contention; then   # the action server beside controlled CPU / simulation load (bench_contention.py)
  echo "=== contention: bench/device/bench_contention.py $CONT_ARGS"
  timeout -k 10 ${CONT_T:-300} python3 bench/device/bench_contention.py --out "$OUT/contention.json" $CONT_ARGS
  stamp contention $?
fi

if part sft; then
  # one bench_train call per variant (';'-separated extra key=value sets; default: the trainer's defaults), each
  # `runs` processes of the same command under one SFT_T limit; a variant's batch=/runs=/steps= override the above
  B=$(echo "$SFT" | sed -n 's/.*batch=\([0-9]*\).*/\1/p')
  SFT_ARGS=$(echo "$SFT" | sed "s/batch=[0-9]*/batch=$(( B * NGPU ))/")
  i=0
  set -f   # a variant's module-name globs (compile=und.language_model.layers.*) are arguments, not file patterns
  IFS=';' read -ra VARS <<< "${SFT_VARIANTS:-}"
  [ ${#VARS[@]} -eq 0 ] && VARS=("")
  for v in "${VARS[@]}"; do
    J="$OUT/sft.json"; [ ${#VARS[@]} -gt 1 ] && J="$OUT/sft_$i.json"
    echo "=== sft: bench/bench_train.py device=cuda size=1b nproc=$NGPU $SFT_ARGS trainable=$SFT_TRAIN $v"
    timeout -k 10 $SFT_T python3 bench/bench_train.py device=cuda size=1b nproc="$NGPU" $SFT_ARGS trainable=$SFT_TRAIN \
      peak_tflops=989 json="$J" out=/tmp/train.md $v
    stamp "sft $v" $?
    i=$(( i + 1 ))
  done
  set +f
fi

if part eval; then
  for sc in ${EVALSCALES//,/ }; do
    # EVAL_NTASKS (default 4, at most 16) x 50 init states cap the plan's episodes: 6 tasks (MetaWorld's default
    # list in wamkit) let 16-env rows of 500-step episodes last ~30 s on the GPU; 32-env rows need ~13 (500
    # episodes of 10 tasks ran 24-30 s in session 22). Beyond 6, ten more V3 tasks join the list (env_args.tasks),
    # in this order (the last six since session 23: 700 episodes of 14 tasks, ~35 s rows at 32 envs)
    NT=${EVAL_NTASKS:-4}; ENVS=${sc%x*}; EPS=${sc#*x}; TRIALS=$(( EPS / NT ))
    [ "$NT" -gt 16 ] && { echo "EVAL_NTASKS=$NT: at most 16"; exit 2; }
    TASKARG="tasks=$(seq -s, 0 $(( NT - 1 )))"
    EXTRA_TASKS=()
    if [ "$NT" -gt 6 ]; then   # wamkit's default list (envs/metaworld.py DEFAULT_TASKS), then ten more
      EXTRA_TASKS=("env_args.tasks=$(python3 -c 'from wamkit.envs.metaworld import DEFAULT_TASKS as D
print(",".join(D + ("window-open-v3", "drawer-close-v3", "button-press-v3", "reach-wall-v3", "window-close-v3",
                  "door-close-v3", "plate-slide-v3", "handle-press-v3", "coffee-button-v3", "dial-turn-v3")))')")
    fi
    # eval_args come last on the command line, so a max_steps= there wins: say that one
    STEPS=$EVAL_STEPS; for w in $EVAL_ARGS; do case $w in max_steps=*) STEPS=${w#max_steps=};; esac; done
    echo "=== eval: $EPS episodes, $ENVS envs ($NT tasks x $TRIALS trials, max_steps=$STEPS)"
    ROWARG=(); [ -n "$EVAL_ROWS" ] && ROWARG=("rows=$EVAL_ROWS")
    if [ -z "$EVAL_ROWS" ]; then   # the (B, P) grid with B x P = envs (B = envs, envs/2, 4, 1 from 16 envs), serial, auto
      if [ "$ENVS" -ge 16 ]; then
        ROWARG=("rows=single-batch;serial;B=$ENVS, P=1;B=$(( ENVS / 2 )), P=2;B=4, P=$(( ENVS / 4 ));B=1, P=$ENVS;auto")
      else ROWARG=("rows=single-batch;serial;B=$ENVS, P=1;B=$(( ENVS / 2 )), P=2;B=2, P=$(( ENVS / 2 ));B=1, P=$ENVS;auto"); fi
    fi
    # ngpu=N > 1: the same rows with one server, then with N servers (one per GPU, least-loaded dispatch)
    REPS="1"; [ "$NGPU" -gt 1 ] && REPS="1 $NGPU"
    for R in $REPS; do
      TAG="${ENVS}x${EPS}"; [ "$R" -gt 1 ] && TAG="${TAG}_${R}servers"
      GPUS=$(seq -s, 0 $(( R - 1 )))
      # a fresh directory per run: a warm machine keeps /tmp between calls, and bench eval refuses an out= that
      # already holds results (resume=true continues one)
      EW=$(mktemp -d "/tmp/eval_$TAG.XXXX")
      # deadline_s: the bench starts no row it cannot finish (with its bound) before the timeout, so a long call
      # ends with a report over the rounds every row finished instead of being cut in a row (session 23)
      timeout -k 10 $EVAL_T python3 -m wamkit.cli.main bench eval bench/device/eval_metaworld.yaml num_envs="$ENVS" \
        deadline_s=$(( EVAL_T - 15 )) \
        "$TASKARG" trials="$TRIALS" max_steps="$EVAL_STEPS" out="$EW" server.replicas="$R" server.gpus="$GPUS" \
        "${ROWARG[@]}" "${EXTRA_TASKS[@]}" $EVAL_ARGS
      rc=$?
      cp "$EW/bench_eval.json" "$OUT/eval_$TAG.json" 2>/dev/null \
        || cp "$EW/bench_eval.partial.json" "$OUT/eval_${TAG}_partial.json" 2>/dev/null
      # each row's summary, report, timeline plot and spans (timeline.json) in one archive: the device tool brings
      # back at most 8 files, 2 folders down (rounds > 1 nest the rows: ROW/roundK/)
      ROWS=$(cd "$EW" && find . -mindepth 2 -maxdepth 3 \( -name summary.json -o -name report.md -o -name timeline.png \
        -o -name timeline.json \) | sort)
      [ -n "$ROWS" ] && (cd "$EW" && tar czf "$OUT/eval_${TAG}_rows.tar.gz" $ROWS)
      [ $rc -ne 0 ] && tail -n 30 "$EW"/*/server*.log 2>/dev/null | tail -n 60
      stamp "eval $TAG" $rc
    done
  done
fi
echo "=== all done after $(( $(date +%s) - T0 )) s"
