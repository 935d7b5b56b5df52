"""`device=auto|cpu|cuda` (train, serve, eval): one rule for what `auto` means: a CUDA GPU when one is usable."""

from __future__ import annotations

import glob
import os
import sys

from wamkit.core.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def _no_gpu_here() -> bool:
    """True when this machine certainly has no usable NVIDIA GPU (no driver device node, or none made visible):
    `auto` then resolves without importing torch (servers of torch-free policies start faster)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return True
    return not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/nvidiactl")


def cuda_available() -> bool:
    if "torch" not in sys.modules and _no_gpu_here():
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(device: str) -> str:
    """auto -> "cuda" when a GPU is usable, else "cpu"; cuda without one is a UserError; cpu stays cpu."""
    if device not in DEVICE_CHOICES:
        raise UserError(f"device: {device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise UserError("device=cuda but no CUDA device is available")
    return device
