#!/usr/bin/env bash
# Build .mesa/osmesa.tar.xz here (a Debian machine with apt and deb.debian.org), for `run_all.sh gl=osmesa` on the
# device: Mesa's OSMesa (llvmpipe) from bookworm-backports and the libraries it needs that the device may lack
# (libLLVM-15 from bookworm; libdrm2 and libz3-4 as fallbacks, dropped there when the machine has its own).
# ~32 MB: it does not fit one call beside the metaworld wheel (64 MiB in all), so carry it in an earlier call on the
# same warm machine (setup_osmesa.sh leaves it unpacked) or with .whl-lite (the wheels without metaworld).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
cd "$T"
deb() {  # newest $1 in suite $2 of deb.debian.org
  local f
  f=$(curl -fsS "http://deb.debian.org/debian/dists/$2/main/binary-amd64/Packages.xz" | xz -d \
      | awk -v RS= -v p="$1" '$0 ~ "^Package: " p "\n"' | sed -n 's/^Filename: //p' | tail -n 1)
  curl -fsSO "http://deb.debian.org/debian/$f"
}
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
mkdir -p "$ROOT/.mesa" "$ROOT/.whl-lite"
tar cf - -C b lib | xz -9 -T0 > "$ROOT/.mesa/osmesa.tar.xz"
for w in "$ROOT"/.whl/*.whl; do case "$w" in *metaworld*) ;; *) cp "$w" "$ROOT/.whl-lite/";; esac; done
rm -rf "$T"
ls -la "$ROOT/.mesa/osmesa.tar.xz"
