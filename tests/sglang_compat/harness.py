"""SGLang's real action router (sglang 0.5.23, `sglang/multimodal_gen/runtime/entrypoints/action/`) on a CPU, with
only the model call replaced, for tests/test_sglang_compat.py. Runs in the side venv `.venv-sglang` (`make
sglang-env`: the sglang wheel without its GPU dependencies, layered over the project's venv).

What is SGLang's own code here: the FastAPI router and its request parsing (JSON / msgpack with numpy markers),
`build_cosmos3_action_sampling_params` (defaults, batch limit, horizon/frames/domain rules), Cosmos3SamplingParams and
its `_adjust`, `prepare_request`, `cosmos3_action_metadata`, `action_generation_response`, and, inside the replaced
model call, the caption builder (`build_action_prompt`) and the action (de)normalization (`denormalize_action`) the
Cosmos3 pipeline applies. What is replaced: the model-registry lookup of the sampling-params class (it reads a model
directory; Cosmos3's class is given) and `async_scheduler_client.forward` (the GPU pipeline): its answer comes from
wamkit's `cosmos3-standin` (any wamkit policy behind Cosmos3's output format), truncated to raw_action_dim and
denormalized exactly where SGLang's pipeline does it. Every request is logged as one JSON line (`--log`).

    .venv-sglang/bin/python tests/sglang_compat/harness.py --port P [--batching-max-size N] [--action-stats F]
        [--inner fixed-cost --inner-args '{"base_ms": 0}'] --standin-stats F --log F
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_stubs  # noqa: E402

import_stubs.install()

import numpy as np  # noqa: E402


def build_app(args):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    import sglang.multimodal_gen.runtime.entrypoints.action.protocol as sg_protocol
    from sglang.multimodal_gen.configs.pipeline_configs.cosmos3 import Cosmos3Config
    from sglang.multimodal_gen.configs.sample.cosmos3 import Cosmos3SamplingParams
    from sglang.multimodal_gen.runtime.entrypoints.action.api import router
    from sglang.multimodal_gen.runtime.server_args import ServerArgs
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.cosmos3_action import (
        build_action_prompt, denormalize_action, load_action_stats)

    from wamkit.core.types import Observation
    from wamkit.policies import make_policy

    pipeline_config = Cosmos3Config()
    pipeline_config.action_stats_path = args.action_stats
    pipeline_config.is_edge, pipeline_config.is_nano = False, True
    # SGLang's ServerArgs with its own defaults, built without __post_init__ (which probes GPUs and the model dir)
    server_args = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        setattr(server_args, f.name, default)
    for k, v in dict(pipeline_config=pipeline_config, batching_max_size=args.batching_max_size,
                     served_model_name="cosmos3-standin", model_path="/models/cosmos3-standin", num_gpus=1,
                     tp_size=1, sp_degree=1, ulysses_degree=1, ring_degree=1).items():
        setattr(server_args, k, v)
    standin = make_policy("cosmos3-standin", inner=args.inner, inner_args=json.loads(args.inner_args),
                          action_stats=args.standin_stats, max_batch_size=max(64, args.batching_max_size))
    log = open(args.log, "a", buffering=1)

    # the model registry reads a model directory: Cosmos3's sampling-params class is given instead
    sg_protocol._resolve_action_sampling_params_cls = lambda server_args: Cosmos3SamplingParams

    async def forward(req):
        """Stands in for the GPU pipeline: the stand-in policy's normalized 10-D actions (padded to 64), cut to
        raw_action_dim and denormalized where SGLang's Cosmos3 decoding stage does it."""
        import torch

        sp = req.sampling_params
        images = sp.image_path if isinstance(sp.image_path, list) else [sp.image_path]
        prompts = sp.prompt if isinstance(sp.prompt, list) else [sp.prompt]
        arrays = [np.asarray(im.convert("RGB"), np.uint8) for im in images]
        caption = build_action_prompt(prompts, sp.action_view_point, sp.num_frames, sp.fps, sp.height, sp.width)
        obs = [Observation(images={"image": a}, state=None, task=p) for a, p in zip(arrays, prompts)]
        values = standin.predict(obs, [int(sp.seed)] * len(obs))
        actions = torch.from_numpy(values)
        raw = sp.raw_action_dim
        if raw is not None:
            actions = actions[:, :, :int(raw)]
        if sp.action_stats_path is not None:
            actions = denormalize_action(actions, sp.action_normalization, load_action_stats(sp.action_stats_path))
        log.write(json.dumps({
            "request_id": sp.request_id, "batch": len(obs), "prompts": prompts, "captions": caption,
            "seed": int(sp.seed), "height": sp.height, "width": sp.width, "fps": sp.fps, "num_frames": sp.num_frames,
            "num_inference_steps": sp.num_inference_steps, "view_point": sp.action_view_point,
            "domain_name": sp.domain_name, "raw_action_dim": raw, "image_shapes": [list(a.shape) for a in arrays],
            "image_sha256": [hashlib.sha256(a.tobytes()).hexdigest() for a in arrays],
            "server_stats": sp.action_stats_path is not None}) + "\n")
        out = actions.numpy()
        output = {"request_id": sp.request_id, "actions": out[0] if len(obs) == 1 else out, "action_mode": "policy",
                  "domain_id": 5, "raw_action_dim": raw}
        return types.SimpleNamespace(error=None, output=[output])

    sg_protocol.async_scheduler_client = types.SimpleNamespace(forward=forward)

    app = FastAPI()
    app.state.server_args = server_args
    app.include_router(router)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--batching-max-size", type=int, default=1)
    ap.add_argument("--action-stats", default=None, help="server-side stats: SGLang denormalizes itself")
    ap.add_argument("--standin-stats", required=True, help="the stats the stand-in model normalizes with")
    ap.add_argument("--inner", default="fixed-cost")
    ap.add_argument("--inner-args", default='{"base_ms": 0, "per_obs_ms": 0}')
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    import uvicorn

    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
