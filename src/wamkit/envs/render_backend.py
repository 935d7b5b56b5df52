"""Which OpenGL MuJoCo renders with in env processes: the env configs' `render_backend` (auto|egl|osmesa) and
`render_device` (auto|<EGL device index>), turned into MUJOCO_GL / PYOPENGL_PLATFORM / MUJOCO_EGL_DEVICE_ID before
mujoco is imported (it reads them at import).

- egl | osmesa: used as given (they override a MUJOCO_GL in the environment).
- auto: a MUJOCO_GL set by the user wins. Else the choice is measured once per machine: each candidate backend renders
  a small scene at the env's image size in its own short-lived process (render_probe.py; a GL stack that crashes
  takes only that process down, and the backend is skipped and named), and the fastest per frame that works is
  chosen. The result is cached as JSON in cache_dir() (RENDER_CACHE) under a key of hostname, GPU/driver identity
  (`nvidia-smi -L` and the driver version, or "cpu"), mujoco version, image size and render_device; a changed key
  measures again. One line says what was chosen and why (figures).
- With several GPUs, an EGL device that is not the model's GPU (MODEL_GPU, what device=auto uses) is preferred
  when it renders; env workers are spread over all such devices. With one GPU, EGL on the model's GPU is measured
  against osmesa (llvmpipe on the CPU): the measurement is of each backend alone and cannot see the contention
  with inference on that GPU; render_backend=osmesa (or egl) decides it by hand.

Where it is applied: EnvWorker.start resolves `auto` once in the parent (worker_kwargs) and gives each env process
concrete values; make_env applies them (apply_render_options) before the env module imports mujoco.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wamkit.core.errors import ConfigError, UserError
from wamkit.core.files import write_atomic
from wamkit.envs.process_setup import GL_SET_MARK, GL_VARS, cache_dir

BACKENDS = ("egl", "osmesa")          # concrete backends, in preference order on a tie
CHOICES = ("auto",) + BACKENDS
PROBE_FRAMES = 10                      # frames timed per backend (after the first, which counts as startup)
PROBE_TIMEOUT_S = 60.0                 # a probe process that takes longer is killed and its backend skipped
TIE = 0.05                             # within 5% per frame of the fastest, the earlier of BACKENDS is kept
MODEL_GPU = 0                          # CUDA ordinal of the model's GPU (device=auto / cuda puts the model there)
RENDER_CACHE = "render-backend.json"   # in cache_dir()
PROBE_SCRIPT = Path(__file__).with_name("render_probe.py")


def check_render_options(backend: Any, device: Any) -> None:
    """ConfigError naming the key unless backend is one of CHOICES and device is auto or an index >= 0."""
    if backend not in CHOICES:
        raise ConfigError(f"render_backend must be one of {', '.join(CHOICES)}, got {backend!r}")
    if parse_device(device) is None and str(device) != "auto":
        raise ConfigError(f"render_device must be auto or an EGL device index >= 0, got {device!r}")


def parse_device(device: Any) -> int | None:
    """'3' or 3 -> 3; auto (or anything else) -> None."""
    s = str(device).strip()
    return int(s) if s.isdigit() else None


def gl_env(backend: str, device: int | None = None) -> dict[str, str | None]:
    """The variables that select `backend` (None: unset). MUJOCO_EGL_DEVICE_ID only for egl with a device."""
    return {"MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend,
            "MUJOCO_EGL_DEVICE_ID": str(device) if backend == "egl" and device is not None else None}


def user_mujoco_gl() -> str | None:
    """MUJOCO_GL as the user set it; None when unset or when wamkit set it (process_setup's default, or a backend
    applied here): those carry GL_SET_MARK."""
    v = os.environ.get("MUJOCO_GL")
    return None if not v or os.environ.get(GL_SET_MARK) == v else v


# ---- measuring ------------------------------------------------------------------------------------------------------

def _run_probe(args: list[str], env: dict[str, str | None], timeout: float) -> tuple[dict | None, str]:
    """Run render_probe.py in a fresh process with `env` on top of ours; (its JSON, "") or (None, why not)."""
    penv = {k: v for k, v in os.environ.items() if k not in GL_VARS}
    penv.update({k: v for k, v in env.items() if v is not None})
    penv.setdefault("LP_NUM_THREADS", "1")    # as in the env processes: llvmpipe with one thread
    try:
        p = subprocess.run([sys.executable, str(PROBE_SCRIPT), *args], env=penv, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout:.0f} s"
    for line in p.stdout.splitlines():
        if line.startswith("WAMKIT_PROBE "):
            return json.loads(line.split(" ", 1)[1]), ""
    why = f"exit code {p.returncode}" if p.returncode >= 0 else f"killed by signal {-p.returncode}"
    # the error's last line; noise from destructors at exit ("Exception ignored in ...") comes after it
    tail = [s for s in (p.stderr or "").split("Exception ignored")[0].strip().splitlines() if s.strip()]
    return None, why + (f": {tail[-1].strip()[:200]}" if tail else "")


def probe(backend: str, device: int | None, size: int, frames: int = PROBE_FRAMES) -> dict:
    """Render `frames` frames of a small scene at size x size with one backend, in its own process. Always returns
    a dict: backend, device, ok, wall_s and either startup_s / ms_per_frame / renderer, or error."""
    t0 = time.perf_counter()
    res, err = _run_probe(["frames", str(int(size)), str(int(frames))], gl_env(backend, device), PROBE_TIMEOUT_S)
    out: dict[str, Any] = {"backend": backend, "device": device, "ok": res is not None,
                           "wall_s": round(time.perf_counter() - t0, 3)}
    if res is None:
        out["error"] = err
    else:
        out.update({k: res[k] for k in ("startup_s", "ms_per_frame", "renderer")})
    return out


def egl_devices() -> list[dict]:
    """The EGL devices (eglQueryDevicesEXT order = MUJOCO_EGL_DEVICE_ID's), each {index, cuda, drm, software};
    [] when EGL cannot list them."""
    res, _ = _run_probe(["egl-devices"], gl_env("egl"), PROBE_TIMEOUT_S)
    return list(res["devices"]) if res else []


def _nvidia_smi(*args: str) -> str:
    try:
        p = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def machine_identity() -> dict[str, Any]:
    """hostname, gpus (`nvidia-smi -L` lines; [] without NVIDIA GPUs), driver, mujoco version."""
    import importlib.metadata as md

    gpus = [s for s in _nvidia_smi("-L").splitlines() if s.startswith("GPU ")]
    driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").splitlines()[:1] if gpus else []
    try:
        mj = md.version("mujoco")
    except md.PackageNotFoundError:
        mj = "?"
    return {"host": socket.gethostname(), "gpus": gpus, "driver": driver[0] if driver else "", "mujoco": mj}


def _fmt(p: dict) -> str:
    dev = f" device {p['device']}" if p.get("device") is not None else ""
    if not p["ok"]:
        return f"{p['backend']}{dev} failed ({p['error']})"
    return (f"{p['backend']}{dev} {p['ms_per_frame']:.1f} ms/frame, startup {p['startup_s']:.2f} s "
            f"[{p['renderer']}]")


def measure(size: int, device: int | None = None, model_gpu: int = MODEL_GPU,
            gpus: int = 0) -> dict[str, Any]:
    """Probe the candidate backends and choose: {backend, device, devices (EGL devices to spread env workers over),
    reason, probes}. Raises UserError when none renders."""
    probes: list[dict] = []
    if device is None and gpus >= 2:
        devs = egl_devices()
        others = [d["index"] for d in devs if d["cuda"] is not None and d["cuda"] != model_gpu]
        if others:
            p = probe("egl", others[0], size)
            probes.append(p)
            if p["ok"]:
                return {"backend": "egl", "device": others[0], "devices": others, "probes": probes,
                        "reason": f"EGL devices {others} are not the model's GPU (cuda {model_gpu}): "
                                  f"{_fmt(p)}"}
        mine = [d["index"] for d in devs if d["cuda"] == model_gpu]
        device = mine[0] if mine else None
    for b in BACKENDS:
        probes.append(probe(b, device if b == "egl" else None, size))
    ok = [p for p in probes if p["ok"]]   # (an EGL device off the model's GPU that rendered has returned above)
    if not ok:
        raise UserError("render_backend=auto: no backend could render here: " + "; ".join(map(_fmt, probes)) +
                        " (install Mesa's EGL or OSMesa, or set render_backend=egl|osmesa)")
    fastest = min(p["ms_per_frame"] for p in ok)
    best = next(p for p in ok if p["ms_per_frame"] <= fastest * (1 + TIE))
    others_txt = "; ".join(_fmt(p) for p in probes if p is not best)
    gpu_note = " (measured alone: contention with the model on that GPU is not seen)" \
        if best["backend"] == "egl" and gpus else ""
    return {"backend": best["backend"], "device": best["device"], "devices": [], "probes": probes,
            "reason": f"{'fastest' if best['ms_per_frame'] == fastest else f'within {TIE:.0%} of the fastest'}: "
                      f"{_fmt(best)}{gpu_note}" + (f"; vs {others_txt}" if others_txt else "")}


# ---- the cache ------------------------------------------------------------------------------------------------------

def cache_key(ident: dict[str, Any], size: int, device: int | None, model_gpu: int) -> str:
    gpu = " | ".join(ident["gpus"]) + (f" | driver {ident['driver']}" if ident["driver"] else "") \
        if ident["gpus"] else "cpu"
    dev = "auto" if device is None else str(device)
    return (f"{ident['host']} / {gpu} / mujoco {ident['mujoco']} / {int(size)}px / render_device {dev}"
            f" / model_gpu {model_gpu}")


@contextlib.contextmanager
def _locked(path: Path):
    """One measurement per machine at a time (env processes of several runs, Ray actors on one node)."""
    import fcntl

    with open(path.with_suffix(".lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:   # a file system without locks: at worst two processes measure at once
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and isinstance(data.get("entries"), dict) else {"entries": {}}
    except (OSError, ValueError):
        return {"entries": {}}


def choose(size: int, device: int | None = None, model_gpu: int = MODEL_GPU) -> dict[str, Any]:
    """The cached choice for this machine and image size, measured (and cached) when there is none for this key.
    The entry gets `source`: cached | measured, and `cache`: the file."""
    path = cache_dir() / RENDER_CACHE
    ident = machine_identity()
    key = cache_key(ident, size, device, model_gpu)
    with _locked(path):
        data = _read(path)
        entry = data["entries"].get(key)
        if isinstance(entry, dict) and entry.get("backend") in BACKENDS:
            return {**entry, "source": "cached", "cache": str(path)}
        entry = measure(size, device, model_gpu, gpus=len(ident["gpus"]))
        entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data["entries"][key] = entry
        write_atomic(path, json.dumps(data, indent=1))
    return {**entry, "source": "measured", "cache": str(path)}


# ---- resolving and applying -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    backend: str | None             # None: leave MUJOCO_GL as the environment has it
    device: int | None = None       # MUJOCO_EGL_DEVICE_ID (egl only)
    devices: tuple[int, ...] = ()   # EGL devices to spread env workers over (auto with several GPUs)
    line: str = ""                  # what was chosen and why, for the user

    def for_worker(self, index: int) -> int | None:
        return self.devices[index % len(self.devices)] if self.devices else self.device


_resolved: dict[tuple, Resolved] = {}
_said: set[str] = set()
_lock = threading.Lock()   # env workers start from several threads at once: one measures, the others wait


def resolve(backend: str, device: Any, size: int) -> Resolved:
    """The concrete backend for these options on this machine (auto: the user's MUJOCO_GL, else the cached or
    measured choice); memoized per process."""
    check_render_options(backend, device)
    dev = parse_device(device)
    if dev is not None and backend == "egl":   # (auto measures the device and names its failure)
        with _lock:
            check_egl_device(dev)
    if backend != "auto":
        return Resolved(backend, dev if backend == "egl" else None)
    user = user_mujoco_gl()
    if user:
        return Resolved(None, line=f"render_backend=auto: MUJOCO_GL={user} from the environment wins "
                                   f"(unset it to measure, or set render_backend=egl|osmesa)")
    memo = (backend, dev, int(size))
    with _lock:
        return _resolved[memo] if memo in _resolved else _resolve_auto(memo)


_egl_count: list[int] = []   # the EGL devices this process found (listed once)


def check_egl_device(dev: int) -> None:
    """ConfigError (one line, before any env starts) for an EGL device index this machine does not have; MuJoCo's own
    error came from inside every env worker, a long traceback. Nothing is refused when EGL cannot list its devices."""
    if not _egl_count:
        _egl_count.append(len(egl_devices()))
    n = _egl_count[0]
    if n and dev >= n:
        raise ConfigError(f"render_device={dev}: this machine has {n} EGL device(s) (indices 0..{n - 1}; "
                          f"`.venv/bin/python bench/device/gl_check.py` lists them)")


def _resolve_auto(memo: tuple) -> Resolved:
    _, dev, size = memo
    e = choose(size, dev)
    how = "measured now" if e["source"] == "measured" else f"measured {e.get('measured_at', '?')}"
    _resolved[memo] = Resolved(e["backend"], e["device"], tuple(e.get("devices") or ()),
                               line=f"render_backend=auto chose {e['backend']} at {size}px: {e['reason']} "
                                    f"({how}, cached in {e['cache']})")
    return _resolved[memo]


SAID_MARK = "WAMKIT_RENDER_BACKEND_SAID"   # set once the line is printed: env processes spawned after stay quiet


def say(r: Resolved) -> None:
    """Print the resolution's line once: once per process, and not again in the env processes the parent spawns
    (32 env workers printed it 32 times)."""
    if r.line and r.line not in _said and os.environ.get(SAID_MARK) != r.line:
        _said.add(r.line)
        os.environ[SAID_MARK] = r.line
        print(f"wamkit: {r.line}", file=sys.stderr, flush=True)


def apply(r: Resolved, device: int | None = None) -> None:
    """Set the GL variables of `r` in this process (env processes spawned after inherit them). mujoco reads them
    when it is imported: once it is, a different backend is a ConfigError."""
    if r.backend is None:
        return
    env = gl_env(r.backend, device if device is not None else r.device)
    if "mujoco" in sys.modules:
        now = {k: os.environ.get(k) for k in env}
        if now["MUJOCO_GL"] != env["MUJOCO_GL"] or (env["MUJOCO_EGL_DEVICE_ID"] is not None and
                                                    now["MUJOCO_EGL_DEVICE_ID"] != env["MUJOCO_EGL_DEVICE_ID"]):
            raise ConfigError(f"render_backend={r.backend}: mujoco is already loaded in this process with "
                              f"MUJOCO_GL={now['MUJOCO_GL']}; set it before mujoco is imported (env workers do)")
        return
    os.environ.update({k: v for k, v in env.items() if v is not None})   # no device: the user's, if any, stays
    os.environ[GL_SET_MARK] = r.backend


def _options(env_cls: type, kwargs: dict) -> tuple[str, Any, int] | None:
    """(render_backend, render_device, image_size) from kwargs over the config's defaults; None for an env without
    these options."""
    import dataclasses

    cfg = getattr(env_cls, "config_class", None)
    if cfg is None or not dataclasses.is_dataclass(cfg):
        return None
    fields = {f.name: f.default for f in dataclasses.fields(cfg)}
    if "render_backend" not in fields:
        return None
    size = kwargs.get("image_size", fields.get("image_size", 224))
    try:
        size = int(size)
    except (TypeError, ValueError):
        size = 224   # the config's own check names it
    return (kwargs.get("render_backend", fields["render_backend"]),
            kwargs.get("render_device", fields.get("render_device", "auto")), size)


def apply_options(backend: str, device: Any, size: int) -> None:
    """Select the backend in this process (before mujoco is imported). auto once mujoco is loaded: nothing to choose
    any more, whatever the process loaded stays; an explicit other backend then is a ConfigError (apply)."""
    if backend == "auto" and "mujoco" in sys.modules:
        check_render_options(backend, device)
        return
    r = resolve(backend, device, size)
    say(r)
    apply(r)


def apply_render_options(env_cls: type, kwargs: dict) -> None:
    """make_env, before the env is built (and mujoco imported): select the backend of kwargs in this process."""
    opts = _options(env_cls, kwargs)
    if opts is not None:
        apply_options(*opts)


def in_use(env_cls: type | None = None, env: Any = None) -> dict[str, Any] | None:
    """In an env process once its env is built: what MuJoCo renders with ({backend: egl | osmesa | glfw | ...,
    device: the EGL device or None}), from the variables mujoco reads at import (set before it, see apply: an env
    such as LIBERO imports mujoco only when its first scene is built, after this is asked). None for an env without
    MuJoCo rendering (its class has no render options and mujoco is not loaded). The eval's summary counts these
    over its env workers (summary.scheduler.env_render)."""
    if "mujoco" not in sys.modules and (env_cls is None or _options(env_cls, {}) is None):
        return None
    backend = os.environ.get("MUJOCO_GL") or "glfw"   # mujoco's own default without MUJOCO_GL
    out = {"backend": backend,
           "device": parse_device(os.environ.get("MUJOCO_EGL_DEVICE_ID")) if backend == "egl" else None}
    if getattr(getattr(env, "config", None), "renderer", "own") != "own":   # its frames from a render process
        out["renderer"] = "shared"
    return out


def describe(renders: list[dict[str, Any] | None]) -> dict[str, int]:
    """{"egl": 15, "egl device 1": 1, "osmesa": 16, "egl shared": 32, ...}: how many env workers rendered with what
    ("shared": through a shared render process, renderer=shared; None: no MuJoCo, not counted)."""
    return dict(Counter(r["backend"] + (f" device {r['device']}" if r.get("device") is not None else "")
                        + (" shared" if r.get("renderer") == "shared" else "") for r in renders if r))


def worker_kwargs(env_cls: type, kwargs: dict, index: int) -> dict:
    """EnvWorker.start (parent side): the env process's kwargs (env class `env_cls`) with render_backend/render_device
    made concrete (auto measured once here, not in every process; several GPUs: workers spread over the non-model
    ones), and renderer=shared made the socket of the worker's render process (render_service.resolve_renderer)."""
    from wamkit.envs.render_service import resolve_renderer

    opts = _options(env_cls, kwargs)
    if opts is None:
        return kwargs
    r = resolve(*opts)
    say(r)
    if r.backend is None:
        return resolve_renderer(kwargs, None, index)
    dev = r.for_worker(index)
    kwargs = resolve_renderer(kwargs, gl_env(r.backend, dev), index)
    return {**kwargs, "render_backend": r.backend, "render_device": "auto" if dev is None else str(dev)}
