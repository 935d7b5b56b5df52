"""A MetaWorld wheel without the asset files no task opens, so that MetaWorld and Mesa's OSMesa fit one device call.

    python bench/device/slim_metaworld_wheel.py SRC.whl OUT_DIR [--check]

metaworld-3.1.1's wheel is 36.7 MB, 33 of them PNG textures, most of which no V3 task loads; beside the carried
.mesa/osmesa.tar.xz (32.5 MB) it does not fit the 64 MiB a call holds. What is needed is measured, not guessed: every
V3 task (goal-observable, seed 0) is built, reset and rendered once under `strace -f` with the installed metaworld,
and every file under metaworld/assets/ that the run opened is kept (MuJoCo's own reads of meshes and textures
included); the other asset files (.png/.stl/.jpg/...) are left out, RECORD is rewritten. Python files and XMLs all
stay. --check installs the slim wheel in a temporary directory and renders every task from it (64x64, camera corner2)
and from the full install in separate processes: the frames must be identical (exit 1 otherwise).
Run by bench/device/fetch_osmesa.sh (into .whl-lite/).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ASSET_EXT = (".png", ".jpg", ".jpeg", ".stl", ".obj", ".msh", ".skn")

RENDER = r"""
import sys, numpy as np, mujoco, metaworld
from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE as E
out = {}
for name in sorted(E):
    env = E[name](seed=0)
    env.reset()
    r = mujoco.Renderer(env.model, 64, 64)
    r.update_scene(env.data, camera="corner2")
    out[name] = r.render().copy()
    r.close(); env.close()
np.savez(sys.argv[1], **out)
print("rendered", len(out), "tasks from", metaworld.__file__)
"""


def _env(pythonpath: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.setdefault("MUJOCO_GL", "egl")
    env.setdefault("PYOPENGL_PLATFORM", env["MUJOCO_GL"])
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def opened_assets(tmp: Path) -> set[str]:
    """Paths relative to site-packages ('metaworld/assets/...') that a render of every task opened."""
    trace = tmp / "trace.txt"
    subprocess.run(["strace", "-f", "-e", "trace=openat,open", "-o", str(trace), sys.executable, "-c", RENDER,
                    str(tmp / "full.npz")], check=True, env=_env())
    seen = set()
    for m in re.finditer(r'"([^"]*/site-packages/(metaworld/assets/[^"]+))"', trace.read_text(errors="replace")):
        seen.add(os.path.normpath(m.group(2)))
    return seen


def slim(src: Path, out_dir: Path, keep: set[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    dropped, dropped_bytes = [], 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        infos = zin.infolist()
        record_name = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        for i in infos:
            n = i.filename
            if n.startswith("metaworld/assets/") and n.lower().endswith(ASSET_EXT) and os.path.normpath(n) not in keep:
                dropped.append(n)
                dropped_bytes += i.file_size
                continue
            if n != record_name:
                zout.writestr(i, zin.read(n))
        gone = set(dropped)
        record = [line for line in zin.read(record_name).decode().splitlines() if line.split(",", 1)[0] not in gone]
        zout.writestr(record_name, "\n".join(record) + "\n")
    print(f"slim metaworld wheel: left out {len(dropped)} asset files ({dropped_bytes / 2**20:.1f} MiB) no task "
          f"opens; {src.stat().st_size / 2**20:.1f} -> {dst.stat().st_size / 2**20:.1f} MiB: {dst}")
    return dst


def check(whl: Path, tmp: Path) -> bool:
    import numpy as np

    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(target), str(whl)], check=True)
    subprocess.run([sys.executable, "-c", RENDER, str(tmp / "slim.npz")], check=True, env=_env(str(target)))
    full, sl = np.load(tmp / "full.npz"), np.load(tmp / "slim.npz")
    bad = [k for k in full.files if k not in sl.files or not np.array_equal(full[k], sl[k])]
    print(f"check: {len(full.files)} tasks, frames identical to the full install: {not bad}"
          + (f" (differ: {bad})" if bad else ""))
    return not bad



if __name__ == "__main__":
    src, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        keep = opened_assets(tmp)
        whl = slim(src, out_dir, keep)
        if "--check" in sys.argv[3:] and not check(whl, tmp):
            sys.exit(1)
