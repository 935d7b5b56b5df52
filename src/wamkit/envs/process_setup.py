"""Process-level settings for headless simulators: set before mujoco is imported (it reads MUJOCO_GL at import)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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


def setup_headless_gl() -> None:
    """Defaults for offscreen rendering on CPU (Mesa llvmpipe through EGL). The user's explicit settings win.

    MUJOCO_GL=osmesa is the fallback when EGL is unavailable (same pixels, same speed on llvmpipe)."""
    os.environ.setdefault("MUJOCO_GL", "egl")
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
