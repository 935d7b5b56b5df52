#!/usr/bin/env bash
# Build .mesa/osmesa.tar.xz here (a Debian machine with apt and deb.debian.org), for `run_all.sh gl=osmesa|auto` on
# the device: Mesa's OSMesa (llvmpipe) from bookworm-backports and the libraries it needs that the device may lack
# (libLLVM-15 from bookworm; libdrm2 and libz3-4 as fallbacks, dropped there when the machine has its own): 32.5 MB.
# And .whl-lite/: the wheels of .whl/ (WHL_SRC) with MetaWorld slimmed to the asset files its tasks open
# (slim_metaworld_wheel.py, checked: every V3 task renders the same frames): 35.0 -> 9.6 MiB, so .mesa + .whl-lite
# (~52 MiB with .gl and the repo) fit one call's 64 MiB: MetaWorld evaluated with OSMesa, or with render_backend=auto
# choosing, in one call. An existing .mesa/osmesa.tar.xz is kept (FORCE=1 rebuilds it).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WHL_SRC=${WHL_SRC:-$ROOT/.whl}
PY=${PY:-$ROOT/.venv/bin/python}
command -v strace >/dev/null || apt-get install -y strace >/dev/null   # slim_metaworld_wheel.py traces the tasks
T=$(mktemp -d)
cd "$T"
deb() {  # newest $1 in suite $2 of deb.debian.org
  local f
  f=$(curl -fsS "http://deb.debian.org/debian/dists/$2/main/binary-amd64/Packages.xz" | xz -d \
      | awk -v RS= -v p="$1" '$0 ~ "^Package: " p "\n"' | sed -n 's/^Filename: //p' | tail -n 1)
  curl -fsSO "http://deb.debian.org/debian/$f"
}
if [ ! -f "$ROOT/.mesa/osmesa.tar.xz" ] || [ "${FORCE:-0}" = 1 ]; then
  deb libosmesa6 bookworm-backports
  deb libdrm2 bookworm-backports
  deb libllvm15 bookworm
  deb libz3-4 bookworm
  mkdir -p x b/lib
  for f in *.deb; do dpkg -x "$f" x; done
  L=x/usr/lib/x86_64-linux-gnu
  cp "$L"/libLLVM-15.so.1 "$L"/libOSMesa.so.8.0.0 "$L"/libz3.so.4 b/lib/
  cp "$(readlink -f "$L"/libdrm.so.2)" b/lib/libdrm.so.2
  (cd b/lib && ln -s libOSMesa.so.8.0.0 libOSMesa.so.8 && ln -s libOSMesa.so.8 libOSMesa.so)
  mkdir -p "$ROOT/.mesa"
  tar cf - -C b lib | xz -9 -T0 > "$ROOT/.mesa/osmesa.tar.xz"
fi
mkdir -p "$ROOT/.whl-lite"
for w in "$WHL_SRC"/*.whl; do
  case "$w" in
    *metaworld*) "$PY" "$ROOT/bench/device/slim_metaworld_wheel.py" "$w" "$ROOT/.whl-lite" --check;;
    *) cp "$w" "$ROOT/.whl-lite/";;
  esac
done
rm -rf "$T"
ls -la "$ROOT/.mesa/osmesa.tar.xz" "$ROOT/.whl-lite"
du -sh "$ROOT/.mesa" "$ROOT/.whl-lite"
