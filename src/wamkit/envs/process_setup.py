"""Process-level settings for headless simulators: set before mujoco is imported (it reads MUJOCO_GL at import)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

# thread pools of the numeric libraries a simulator process loads (numpy's BLAS, OpenMP): one thread each in an env
# process. N env processes on N cores with a pool of N threads apiece (OpenBLAS busy-waits between calls) oversubscribe
# the machine N-fold; one env is one core's work.
SINGLE_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                      "VECLIB_MAXIMUM_THREADS")


@contextlib.contextmanager
def single_threaded_children():
    """While a child process is spawned: its numeric libraries get one thread (they read these variables when they
    load, before any code of ours runs in the child). The user's own settings win; this process is unchanged after."""
    global _added
    with _lock:   # env workers start from several threads at once: the first sets, the last restores
        _holders[0] += 1
        if _holders[0] == 1:
            _added = [v for v in SINGLE_THREAD_VARS if v not in os.environ]
            for v in _added:
                os.environ[v] = "1"
    try:
        yield
    finally:
        with _lock:
            _holders[0] -= 1
            if _holders[0] == 0:
                for v in _added:
                    os.environ.pop(v, None)
                _added = []


_lock = threading.Lock()
_holders = [0]
_added: list[str] = []


def cache_dir() -> Path:
    root = os.environ.get("WAMKIT_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                              or os.path.expanduser("~/.cache"), "wamkit")
    p = Path(root)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError:
        p = Path(tempfile.gettempdir()) / "wamkit-cache"
        p.mkdir(parents=True, exist_ok=True)
    return p


# the variables that select MuJoCo's OpenGL in a process (read by mujoco at import)
GL_VARS = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "MUJOCO_EGL_DEVICE_ID")

# MUJOCO_GL's value when wamkit set it (this default, or an env config's render_backend): a MUJOCO_GL without this
# mark is the user's, which wins over render_backend=auto (wamkit.envs.render_backend). Children inherit both.
GL_SET_MARK = "WAMKIT_MUJOCO_GL_SET"


def setup_headless_gl() -> None:
    """Defaults for offscreen rendering (EGL: Mesa llvmpipe on a CPU machine). The user's explicit settings win.

    The env configs' render_backend (wamkit.envs.render_backend) chooses EGL or OSMesa per process before this runs;
    this default only holds where nothing chose (in-process use without make_env)."""
    if "MUJOCO_GL" not in os.environ:
        os.environ["MUJOCO_GL"] = os.environ[GL_SET_MARK] = "egl"
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"] if os.environ["MUJOCO_GL"] in ("egl", "osmesa")
                          else "egl")
    os.environ.setdefault("LP_NUM_THREADS", "1")  # llvmpipe: one thread per env process renders fastest overall
    c = cache_dir()
    for var, sub in (("MESA_SHADER_CACHE_DIR", "mesa"), ("MPLCONFIGDIR", "mpl")):
        if var not in os.environ:
            (c / sub).mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(c / sub)


def setup_libero_paths() -> None:
    """Point LIBERO's path config at a wamkit-owned directory with no config.yaml, so the package's own bddl files,
    init states and assets are used (no prompt, no download, no user-level override leaking in)."""
    if "LIBERO_CONFIG_PATH" not in os.environ:
        d = cache_dir() / "libero-config"
        d.mkdir(parents=True, exist_ok=True)
        os.environ["LIBERO_CONFIG_PATH"] = str(d)
