#!/usr/bin/env bash
# Behaviour unchanged? Per-episode eval results (success, steps and the digest of every executed action chunk) and
# training losses / grad norms / checkpoint tensors of an older commit against the work tree, same venv, on the CPU.
#   bash bench/bit_identity.sh BASE_COMMIT [OUT=/tmp/bit]
set -u
BASE=${1:?usage: bench/bit_identity.sh BASE_COMMIT [OUT]}; OUT=${2:-/tmp/bit}
ROOT=$(cd "$(dirname "$0")/.." && pwd); PY=$ROOT/.venv/bin/python
export MUJOCO_GL=egl PYOPENGL_PLATFORM=egl LP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
rm -rf "$OUT"; mkdir -p "$OUT/src_base"; git -C "$ROOT" archive "$BASE" | tar -x -C "$OUT/src_base"
for tag in base head; do
  R=$ROOT; [ $tag = base ] && R=$OUT/src_base
  O=$OUT/$tag; mkdir -p "$O"; cd "$R"; export PYTHONPATH=$R/src
  $PY -m wamkit.cli.main eval env=metaworld env_args.tasks=reach-v3,drawer-open-v3 trials=2 policy=metaworld-expert \
    progress=false out=$O/expert >"$O/expert.log" 2>&1 || echo "expert ($tag) failed"
  $PY -m wamkit.cli.main eval env=metaworld env_args.tasks=reach-v3,push-v3 trials=2 max_steps=32 num_envs=2 mode=auto \
    policy=wam-ref policy_args.size=tiny policy_args.init_seed=0 policy_args.cameras=image policy_args.state_dim=39 \
    progress=false out=$O/wamref >"$O/wamref.log" 2>&1 || echo "wam-ref eval ($tag) failed"
  $PY -m wamkit.cli.main train policy=wam-ref policy_args.size=tiny dataset=tests/fixtures/lerobot_v3_libero_tiny fps=10 \
    num_workers=0 batch_size=2 steps=3 log_every=1 warmup=1 progress=false out=$O/train >"$O/train.log" 2>&1 \
    || echo "train ($tag) failed"
done
cd "$ROOT"
$PY - "$OUT" <<'PYEOF'
import glob, json, sys
import torch
from safetensors.torch import load_file
out = sys.argv[1]
ok = True
def recs(p):
    return {r["key"]: (r["success"], r["steps"], r.get("actions_digest")) for r in map(json.loads, open(p))}
for run in ("expert", "wamref"):
    same = recs(f"{out}/base/{run}/results.jsonl") == recs(f"{out}/head/{run}/results.jsonl")
    ok &= same; print(f"eval {run}: {'identical' if same else 'DIFFERENT'}")
log = {t: [(x["step"], x["loss"], x["grad_norm"]) for x in map(json.loads, open(f"{out}/{t}/train/train_log.jsonl"))]
       for t in ("base", "head")}
same = log["base"] == log["head"]; ok &= same
print(f"train losses/grad norms: {'identical' if same else 'DIFFERENT'} {log['head']}")
ck = {t: load_file(glob.glob(f"{out}/{t}/train/checkpoints/step-*/model/*.safetensors")[0]) for t in ("base", "head")}
same = ck["base"].keys() == ck["head"].keys() and all(torch.equal(ck["base"][k], ck["head"][k]) for k in ck["base"])
ok &= same; print(f"checkpoint tensors: {'identical' if same else 'DIFFERENT'} ({len(ck['head'])} tensors)")
sys.exit(0 if ok else 1)
PYEOF
