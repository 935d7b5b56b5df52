#!/usr/bin/env bash
# Build .whl/ here: the wheels the device image lacks for `wamkit serve` / `wamkit eval` on MetaWorld (run_all.sh
# installs every wheel it finds there). The device has Python 3.12 + torch, numpy, msgpack, httpx, pyarrow, pillow,
# transformers, safetensors... (KINDS.md's package list) but not these: the server (uvicorn, starlette), the
# websocket transport `wamkit eval` speaks to its own servers (websockets), MetaWorld and its simulator (metaworld,
# mujoco, gymnasium, farama-notifications, glfw, PyOpenGL). ~46 MiB: carry `.whl` and `.gl` (the GLVND debs, see the
# device tool's README) in one call. fetch_osmesa.sh slims it to .whl-lite for calls that also carry .mesa.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$ROOT/.whl" \
  uvicorn==0.55.0 starlette==1.10.0 websockets==16.0 metaworld==3.1.1 mujoco==3.3.0 gymnasium==1.4.0 \
  farama-notifications==0.0.4 glfw==2.11.0 PyOpenGL==3.1.10
ls -la "$ROOT/.whl"; du -sh "$ROOT/.whl"
