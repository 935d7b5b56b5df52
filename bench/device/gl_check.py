"""Which OpenGL MuJoCo can render with here, what a frame costs with each, and what render_backend=auto chooses.

    python bench/device/gl_check.py [size=224] [frames=20] [json=PATH]

Every line starts with "gl_check" (run_all.sh keeps only those). Per backend, in its own process (as auto probes):
EGL on its default device, EGL on each listed EGL device when there are several, OSMesa (needs libOSMesa on the
library path: `. bench/device/setup_osmesa.sh` first on the GPU machine). Then auto's choice for this machine, measured
afresh (the line `wamkit eval` would print; the cache in cache_dir() is updated). The MUJOCO_GL of the environment is
ignored here: every backend is measured.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from wamkit.envs import render_backend as rb  # noqa: E402
from wamkit.envs.process_setup import GL_SET_MARK  # noqa: E402


def main(argv: list[str]) -> None:
    opts = dict(a.split("=", 1) for a in argv)
    size, frames = int(opts.get("size", 224)), int(opts.get("frames", 20))
    ident = rb.machine_identity()
    print(f"gl_check host {ident['host']}, mujoco {ident['mujoco']}, GPUs: {ident['gpus'] or 'none'}"
          f"{', driver ' + ident['driver'] if ident['driver'] else ''}; MUJOCO_GL in the environment: "
          f"{os.environ.get('MUJOCO_GL')}", flush=True)
    devs = rb.egl_devices()
    print(f"gl_check EGL devices (MUJOCO_EGL_DEVICE_ID order): {devs or 'none (EGL cannot list devices here)'}",
          flush=True)
    runs = [("egl", None)] + ([("egl", d["index"]) for d in devs] if len(devs) > 1 else []) + [("osmesa", None)]
    probes = []
    for b, d in runs:
        p = rb.probe(b, d, size, frames)
        probes.append(p)
        print(f"gl_check {size}px x{frames}: {rb._fmt(p)} (process {p['wall_s']:.2f} s)", flush=True)
    for v in ("MUJOCO_GL", "PYOPENGL_PLATFORM", GL_SET_MARK):     # auto measures only without a user's MUJOCO_GL
        os.environ.pop(v, None)
    cache = rb.cache_dir() / rb.RENDER_CACHE
    key = rb.cache_key(ident, size, None, rb.MODEL_GPU)
    data = rb._read(cache)
    if data["entries"].pop(key, None) is not None:     # measure afresh: drop this machine's cached entry
        cache.write_text(json.dumps(data, indent=1))
    try:
        r = rb.resolve("auto", "auto", size)
        print(f"gl_check auto: {r.line}", flush=True)
        choice = {"backend": r.backend, "device": r.device, "devices": list(r.devices), "line": r.line}
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"gl_check auto: failed: {type(e).__name__}: {e}", flush=True)
        choice = {"error": f"{type(e).__name__}: {e}"}
    if "json" in opts:
        Path(opts["json"]).write_text(json.dumps({"identity": ident, "egl_devices": devs, "probes": probes,
                                                  "auto": choice, "size": size, "frames": frames}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
