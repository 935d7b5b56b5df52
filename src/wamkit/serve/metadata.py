"""GET /v1/actions/metadata: what a client learns of a running action server (SGLang's metadata layout, plus
wamkit's `server` block, whose `name: "wamkit"` tells a client it may use wamkit's own request forms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamkit.policies.base import PolicySpec
from wamkit.policies.manifest import is_export_dir
from wamkit.protocol.messages import DEFAULT_SEED


def default_steps(spec: PolicySpec) -> int | None:
    """The policy's own number of denoising steps when it says (spec.extra.num_inference_steps), else None."""
    steps = spec.extra.get("num_inference_steps")
    return int(steps) if isinstance(steps, int) and not isinstance(steps, bool) else None


def model_path(policy: str) -> str | None:
    """The export directory the policy was loaded from (SGLang's model_path: what its server was given), None for a
    registered name (a folder named like a policy is not one). Never the absolute path, which tells a client the
    server's file system: the path below the server's working directory (`runs/export/wam-ref-libero`), else the
    directory's own name."""
    if not is_export_dir(policy):
        return None
    path = Path(policy).resolve()
    try:
        rel = path.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.name
    return rel if rel != "." else path.name


def metadata_of(srv: Any) -> dict[str, Any]:
    """The metadata of `srv` (an ActionServer): its policy's spec, limits and capabilities."""
    s, cfg, limits = srv.spec, srv.cfg, srv.limits
    side = s.input.image_size or None   # a square side the policy resizes to; 0: any size
    return {
        "object": "action.metadata", "model": srv.model, "model_path": model_path(cfg.policy), "policy_family": s.name,
        "policy": s.to_dict(),
        "input": {"image_keys": list(s.input.cameras), "image_size": [side, side] if side else None,
                  "state_dim": s.input.state_dim or None, "text": s.input.text, "modalities": ["image"],
                  "supported_resolutions": [[side, side]] if side else None},
        "output": {"action_type": "continuous", "action_horizon": s.action.horizon, "action_dim": s.action.dim,
                   "padded_action_dim": s.action.dim, "dtype": "float32"},
        "runtime": {"parallelism": {"num_gpus": None, "tp_size": 1, "sp_degree": 1, "ulysses_degree": 1,
                                    "ring_degree": 1},
                    "concurrent_batches": len(srv.replicas), "policy_process": bool(cfg.policy_process)},
        "defaults": {"action_mode": "policy", "action_horizon": s.action.horizon,
                     "num_inference_steps": default_steps(s), "seed": DEFAULT_SEED,
                     "height": side, "width": side, "fps": None, "prefix_cache": False, "cuda_graph": None},
        "capabilities": {"action_modes": ["policy"], "batch_inputs": True, "max_batch_size": srv.max_batch_size,
                         "batched_action_modes": ["policy"], "multiple_candidates": False,
                         "exact_prefix_cache": False,
                         "realtime_websocket": True, "multiple_cameras": True, "state": True,
                         "per_observation_seeds": True, "openpi_websocket": True, "msgpack": True,
                         "shm_arrays": srv.shm is not None},
        "server": {"name": "wamkit", "max_wait_ms": cfg.max_wait_ms,
                   "max_wait_fraction": cfg.max_wait_fraction, "max_queue": cfg.max_queue,
                   "concurrent_batches": len(srv.replicas),
                   "max_body_bytes": srv.max_body, "auth": srv.token is not None,
                   "instance_id": srv.instance_id, "max_image_pixels": limits.max_image_pixels,
                   "max_decoded_bytes": limits.max_decoded_bytes, "max_depth": limits.max_depth},
    }
