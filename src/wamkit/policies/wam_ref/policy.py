"""`wam-ref`: the built-in reference World Action Model (Qwen3-VL understanding tower + flow-matching action tower).

    policy = make_policy("wam-ref", size="tiny", action_dim=7, horizon=16)
    actions = policy.predict(observations, seeds)         # (N, 16, 7) env space
    loss, metrics = policy.sft_loss(batch)                 # batch collated by wamkit.data.samples
    policy.save_pretrained("runs/export")                   # -> make_policy("runs/export")

Inference computes the understanding prefix (images + task text) ONCE per observation per `predict` call and reuses
its per-layer K/V for all `num_inference_steps` Euler steps. Noise comes from `torch.Generator().manual_seed(seeds[i])`
per observation; every observation's prefix has the same length (text right-padded to `max_text_len`), so an
observation's result does not depend on its batch mates (pinned by tests/test_policy_wam_ref.py).

The pieces, one module each: `config` (WamRefConfig: every option), `build` (towers, init), `inputs` (observations
-> model inputs), `engine` (prefix pass + denoising: CUDA graphs, buckets, compile, K/V layout), `prefix` (the
graph-capturable prefix pass), `fused` (fused inference weights), `model` (the network), `cost` (parameter and FLOP
counts), `training` (the trainer-facing interface, a mixin of this class). This class wires them and is what the
server, the evaluator and the trainer talk to.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec
from wamkit.policies.tokenizer import load_tokenizer
from wamkit.policies.wam_ref.cost import flops_per_observation as count_flops, num_parameters as count_parameters
from wamkit.policies.wam_ref.build import (batch_vision_attention, build_model, generation_width, init_on,
                                          understanding_tower)
from wamkit.policies.wam_ref.config import (Placement, WamRefConfig, as_action_pipeline, dtype_name,
                                           model_action_dim, to_dtype)
from wamkit.policies.wam_ref.engine import InferenceEngine, twin_engine
from wamkit.policies.wam_ref.inputs import InputProcessor
from wamkit.policies.wam_ref.training import WamRefTraining
from wamkit.policies.wam_ref.sizes import get_size


def _engine_option(name: str, doc: str) -> property:
    """A policy attribute that is the inference engine's (settable: e.g. bench scripts switch cuda_graphs)."""
    return property(lambda self: getattr(self.engine, name), lambda self, v: setattr(self.engine, name, v), doc=doc)


class WamRefPolicy(WamRefTraining, Policy):
    """The reference WAM. See the module docstring and docs/models.md; options: `WamRefConfig`."""

    config_class = WamRefConfig      # its options (make_policy refuses any other key)

    name = "wam-ref"
    # what the saved weights fix: an export loaded with another value for one of these is refused (export.py);
    # `size` is a preset whose shapes the export also saves as explicit keys, so changing it alone changed nothing;
    # `horizon` changes no shape, but the trained network denoises that many action tokens together: asked for
    # fewer, it is another model (the chunk is cut instead: `action_horizon`, eval's `horizon=`)
    architecture_keys = ("size", "und_config", "und_path", "gen_hidden_size", "gen_intermediate_size", "image_size",
                         "max_text_len", "state_dim", "action_dim", "horizon")

    def __init__(self, config: WamRefConfig | None = None, **kwargs):
        cfg = WamRefConfig.from_kwargs(**kwargs) if config is None else dataclasses.replace(config, **kwargs)
        self.config = cfg
        preset = get_size(cfg.size)
        self.placement = Placement(torch.device(cfg.device), cfg.torch_dtype)
        self.num_inference_steps = cfg.num_inference_steps
        self.trainable_patterns = cfg.trainable_patterns
        self.env_action_dim, self.horizon, self.state_dim = cfg.action_dim, cfg.horizon, cfg.state_dim
        self._max_batch_size = cfg.max_batch_size
        pipe = as_action_pipeline(cfg.action_pipeline)
        self.model_action_dim = model_action_dim(pipe, self.env_action_dim)
        self._action_pipeline = pipe

        towers = understanding_tower(cfg)
        self.qwen_config = qcfg = towers.config
        vc = qcfg.vision_config
        self.tokenizer = load_tokenizer(cfg.tokenizer_dir or cfg.und_path, qcfg)
        self.inputs = InputProcessor(
            cameras=cfg.cameras, image_size=cfg.image_size or preset.image_size, patch_size=vc.patch_size,
            merge=vc.spatial_merge_size, temporal=vc.temporal_patch_size,
            max_text_len=cfg.max_text_len or preset.max_text_len, state_dim=cfg.state_dim,
            image_mean=cfg.image_mean, image_std=cfg.image_std, tokenizer=self.tokenizer, placement=self.placement)
        self.gen_hidden, self.gen_ffn = generation_width(cfg, qcfg.text_config)
        self.model = build_model(cfg, towers, self.model_action_dim, self.placement.device)
        self.inputs.rope_index = self.model.und.get_rope_index
        self.model.set_static_layout(self.inputs.image_slots)   # training's prefix without host syncs
        self.apply_trainable_patterns()
        self.batched_vision_attention = cfg.batched_vision_attention and batch_vision_attention(self.model)
        if cfg.und_path is None and self.device.type not in ("cpu", "meta"):
            self.materialize(self.device)  # built on the meta device (a CPU build of a big model takes minutes)
        self.engine = InferenceEngine(
            self.model, qcfg.text_config, horizon=self.horizon, model_action_dim=self.model_action_dim,
            state_dim=self.state_dim, placement=self.placement, cuda_graphs=cfg.cuda_graphs,
            kv_layout=cfg.kv_layout, compile=False, buckets=cfg.buckets, image_slots=self.inputs.image_slots,
            fused=cfg.fused, prefix_graphs=cfg.prefix_graphs, gemm=cfg.gemm)
        self.engine.prefix_pass.fold = cfg.prefix_fold
        self.engine.prefix_pass.compile_as = cfg.compile_prefix
        self.engine.prefix_pass.causal = cfg.prefix_attention == "causal"
        for blk in self.model.gen.blocks:
            blk.attention = cfg.attention
            blk.residual_carry = cfg.residual_carry
        if cfg.compile:
            self.engine.enable_compile()
        self._stream = None   # a CUDA stream of its own once replicas exist (replica())
        self.spec = PolicySpec(
            name="wam-ref",
            input=InputSpec(cameras=self.cameras, image_size=self.image_size, state_dim=self.state_dim, text=True),
            action=ActionSpec(dim=self.env_action_dim, horizon=self.horizon,
                              representation=f"model{self.model_action_dim}"),
            deterministic=True, trainable=True,
            extra={"size": cfg.size, "num_inference_steps": self.num_inference_steps,
                   "prefix_len": self.prefix_len, "model_action_dim": self.model_action_dim})

    # ------------------------------------------------------------------ where the weights live
    device = property(lambda self: self.placement.device)
    dtype = property(lambda self: self.placement.dtype)

    def materialize(self, device="cuda", dtype=None) -> "WamRefPolicy":
        """Meta-built model -> real tensors on `device` (`to_empty` + deterministic init, rotary buffers recomputed)."""
        self.placement.device = torch.device(device)
        if dtype is not None:
            self.placement.dtype = to_dtype(dtype)
        init_on(self.model, self.device, self.config.init_seed)
        self.model.to(dtype=self.dtype)
        self.apply_trainable_patterns()
        return self

    # ------------------------------------------------------------------ inputs (InputProcessor)
    cameras = property(lambda self: self.inputs.cameras)
    image_size = property(lambda self: self.inputs.image_size)
    max_text_len = property(lambda self: self.inputs.max_text_len)
    tokens_per_image = property(lambda self: self.inputs.tokens_per_image)
    prefix_len = property(lambda self: self.inputs.prefix_len)

    def prepare_inputs(self, images, tasks: Sequence[str], states=None) -> dict[str, torch.Tensor]:
        """Model inputs for a batch. images: {camera: (B,H,W,3) uint8} or a list of per-observation dicts."""
        return self.inputs.prepare(images, tasks, states)

    # ------------------------------------------------------------------ inference (InferenceEngine)
    cuda_graphs = _engine_option("cuda_graphs", "replay the denoising loop from CUDA graphs (CUDA devices)")
    kv_layout = _engine_option("kv_layout", "prefix K/V layout while denoising: expanded | room | folded")
    prefix_graphs = _engine_option("prefix_graphs", "with cuda_graphs, replay the prefix pass from CUDA graphs too")
    fused = _engine_option("fused", "fused q/k/v and gate/up GEMMs at inference (off: the reference path)")
    gemm = _engine_option("gemm", "denoising-loop GEMM kernels: cublas | triton | autotune")
    compile = property(lambda self: self.engine.compile)
    graph_buckets = property(lambda self: self.engine.buckets)
    gen_tokens = property(lambda self: self.engine.gen_tokens)

    def noise(self, seeds: Sequence[int]) -> torch.Tensor:
        return self.engine.noise(seeds)

    def sample(self, inputs: dict[str, torch.Tensor], seeds: Sequence[int],
               num_inference_steps: int | None = None) -> torch.Tensor:
        """Model-space action chunks (N, horizon, model_action_dim) float32: one prefix pass, then Euler steps."""
        return self.engine.sample(inputs, seeds, int(num_inference_steps or self.num_inference_steps))

    def release_graphs(self) -> None:
        self.engine.release_graphs()

    def enable_compile(self) -> None:
        """What compile=true does (also callable after construction); see InferenceEngine.enable_compile."""
        self.engine.enable_compile()

    def warmup(self, max_batch_size: int | None = None) -> dict[str, float]:
        """Do the one-off work before serving: with cuda_graphs on a CUDA device, capture the denoising graph (and
        with prefix_graphs the prefix graph) of every bucket up to `max_batch_size` (compiling first when compile=true);
        otherwise one predict of a single observation (library handles, kernel selection, fused weights). Returns
        seconds per bucket."""
        top = min(int(max_batch_size or self._max_batch_size), self._max_batch_size)
        sizes = [b for b in self.graph_buckets if b <= top] if self.engine.graphed() else [1]
        g = np.random.default_rng(0)
        out = {}
        for b in sizes:
            obs = self.synthetic_observations(b, g)
            t0 = time.perf_counter()
            self.predict(obs, list(range(b)))
            out[str(b)] = time.perf_counter() - t0
        return out

    def synthetic_observations(self, n: int, rng: np.random.Generator) -> list[Observation]:
        """n observations of this policy's shape (random images of every camera, zero state) for warm-ups and
        benchmarks."""
        side = self.image_size
        return [Observation({c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for c in self.cameras},
                            np.zeros(self.state_dim, np.float32) if self.state_dim > 0 else None, "warm up")
                for _ in range(n)]

    def max_batch_size(self) -> int:
        return self._max_batch_size

    def replica(self) -> "WamRefPolicy":
        """A handle that may predict at the same time as this one, from another thread: the same model and weights,
        its own inference engine (CUDA graphs, static buffers: engine.twin_engine). On a CUDA device each handle then
        runs on a CUDA stream of its own (this one's included), so two batches overlap on the GPU."""
        if self.device.type == "meta":
            raise UserError("this wam-ref was built on the meta device: call materialize(device) first")
        twin = copy.copy(self)
        twin.engine = twin_engine(self.engine)
        if self.device.type == "cuda":
            self._stream = self._stream or torch.cuda.Stream(self.device)
            twin._stream = torch.cuda.Stream(self.device)
        return twin

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        if len(observations) != len(seeds):
            raise UserError(f"predict got {len(observations)} observations and {len(seeds)} seeds")
        if self.device.type == "meta":
            raise UserError("this wam-ref was built on the meta device: call materialize(device) first")
        if self._stream is not None:   # a replica's (or its original's) own stream: see replica()
            with torch.cuda.stream(self._stream):
                return self._predict(observations, seeds)
        return self._predict(observations, seeds)

    def _predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        out = np.zeros((len(observations), self.horizon, self.env_action_dim), np.float32)
        for s in range(0, len(observations), self._max_batch_size):
            obs = observations[s:s + self._max_batch_size]
            inputs = self.prepare_inputs([o.images for o in obs], [o.task for o in obs],
                                         [o.state for o in obs] if self.state_dim > 0 else None)
            a = self.sample(inputs, seeds[s:s + self._max_batch_size]).cpu().numpy()
            env = np.asarray(self.action_pipeline.inverse(a), np.float32)
            out[s:s + len(obs)] = env
        return out

    # ------------------------------------------------------------------ export / loading
    def export_config(self) -> dict[str, Any]:
        """Constructor kwargs that rebuild this policy's shape (weights come from model.safetensors)."""
        c = self.config
        return {
            "size": c.size, "action_dim": self.env_action_dim, "horizon": self.horizon,
            "cameras": list(self.cameras), "image_size": self.image_size, "state_dim": self.state_dim,
            "num_inference_steps": self.num_inference_steps, "dtype": dtype_name(self.dtype),
            "und_config": self.qwen_config.to_dict(), "gen_hidden_size": self.gen_hidden,
            "gen_intermediate_size": self.gen_ffn, "max_text_len": self.max_text_len,
            "trainable_patterns": list(self.trainable_patterns), "action_lr_multiplier": c.action_lr_multiplier,
            "image_mean": list(c.image_mean), "image_std": list(c.image_std), "max_batch_size": self._max_batch_size,
        }

    def save_tokenizer(self, directory: Path) -> dict[str, Any]:
        """Extra export files: a local HF tokenizer when the policy uses one (byte-level needs nothing)."""
        tok = getattr(self.tokenizer, "tok", None)
        if tok is None:
            return {}
        tok.save_pretrained(str(directory / "tokenizer"))
        return {"tokenizer_dir": "tokenizer"}

    def save_pretrained(self, directory) -> Path:
        from wamkit.policies.export import save_exported

        return save_exported(self, directory)

    @classmethod
    def from_pretrained(cls, directory, **overrides) -> "WamRefPolicy":
        from wamkit.policies.export import load_exported

        pol = load_exported(directory, **overrides)
        if not isinstance(pol, cls):
            raise UserError(f"{directory} holds a {type(pol).__name__}, not a {cls.__name__}")
        return pol

    # ------------------------------------------------------------------ sizes and cost (cost.py)
    def num_parameters(self) -> dict[str, int]:
        return count_parameters(self.model)

    def flops_per_observation(self, num_inference_steps: int | None = None, prefix_len: int | None = None) -> dict:
        """Forward FLOPs per observation; see cost.flops_per_observation."""
        return count_flops(
            self.model, self.qwen_config.text_config, cameras=len(self.cameras), image_size=self.image_size,
            patch_size=self.inputs.patch_size, gen_tokens=self.gen_tokens,
            steps=int(num_inference_steps or self.num_inference_steps), prefix_len=int(prefix_len or self.prefix_len))
