"""`wam-ref`: the built-in reference World Action Model (Qwen3-VL understanding tower + flow-matching action tower).

    policy = make_policy("wam-ref", size="tiny", action_dim=7, horizon=16)
    actions = policy.predict(observations, seeds)         # (N, 16, 7) env space
    loss, metrics = policy.sft_loss(batch)                 # batch collated by wamkit.data.samples
    policy.save_pretrained("runs/export")                   # -> make_policy("runs/export")

Inference computes the understanding prefix (images + task text) ONCE per observation per `predict` call and reuses
its per-layer K/V for all `num_inference_steps` Euler steps. Noise comes from `torch.Generator().manual_seed(seeds[i])`
per observation; every observation's prefix has the same length (text right-padded to `max_text_len`), so an
observation's result does not depend on its batch mates (pinned by tests/test_policy_wam_ref.py).
"""

from __future__ import annotations

import fnmatch
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from wamkit.core.config import parse_bool
from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies.base import ActionSpec, InputSpec, Policy, PolicySpec
from wamkit.policies.tokenizer import load_tokenizer
from wamkit.policies.wam_ref.model import (GenerationTower, Prefix, WamRefModel, head_dim_of, init_weights,
                                          use_batched_vision_attention, write_heads)
from wamkit.policies.wam_ref.sizes import get_size, qwen3vl_config_dict

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if str(d) not in _DTYPES:
        raise UserError(f"unknown dtype {d!r}; valid choices: {', '.join(_DTYPES)}")
    return _DTYPES[str(d)]


def _buckets(spec, max_batch: int) -> tuple[int, ...]:
    """CUDA-graph batch buckets: given (list or comma string) or 1, 2, 4, 8, 16, then steps of a quarter of the
    next power of two (24, 32, 48, 64, 96, ...) up to max_batch, which is always a bucket."""
    if spec:
        vals = [int(v) for v in (spec.split(",") if isinstance(spec, str) else spec)]
    else:
        vals, b = [], 1
        while b < max_batch:
            vals.append(b)
            b = b * 2 if b < 16 else b + (1 << (b.bit_length() - 1)) // 2
    vals = sorted({v for v in vals if 0 < v < max_batch} | {max_batch})
    return tuple(vals)


def _dtype_name(d: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[d]


def as_action_pipeline(p):
    """None / "identity" -> identity pipeline; "rot6d" -> [Rot6dStep]; dict / JSON path / ActionPipeline."""
    from wamkit.data.transforms import ActionPipeline

    if p is None or p == "identity":
        return ActionPipeline([])
    if p == "rot6d":  # 7-D env actions, 10-D model actions
        from wamkit.data.transforms import Rot6dStep

        return ActionPipeline([Rot6dStep()])
    if isinstance(p, ActionPipeline):
        return p
    if isinstance(p, dict):
        return ActionPipeline.from_dict(p)
    if isinstance(p, (str, Path)):
        return ActionPipeline.load(p)
    raise UserError(f"action_pipeline must be an ActionPipeline, a dict or a path, got {type(p).__name__}")


def patchify(img: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """(3, H, W) or (N, 3, H, W) normalized images -> (N*gh*gw, 3*temporal*patch*patch) in Qwen-VL's patch order
    (image after image).

    Patches are grouped by spatial-merge window (merge x merge neighbours contiguous), channels outermost inside a
    patch, and the single frame repeated `temporal` times (what Qwen3-VL's image processor does for still images);
    this is the layout `Qwen3VLVisionPatchEmbed` (Conv3d over (C, T, p, p)) and the patch merger expect."""
    x = img[None] if img.ndim == 3 else img
    n, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    x = x.reshape(n, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)                  # (N, gh/m, gw/m, m, m, C, p, p)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, temporal, -1, -1)
    return x.reshape(n * gh * gw, c * temporal * patch * patch)


class WamRefPolicy(Policy):
    """The reference WAM. See the module docstring and docs/models.md."""

    name = "wam-ref"

    def __init__(self, size: str = "tiny", action_dim: int = 7, horizon: int = 16,
                 cameras: Sequence[str] = ("image", "wrist_image"), image_size: int | None = None,
                 state_dim: int = 0, num_inference_steps: int = 10, action_pipeline=None, device: str = "cpu",
                 dtype="float32", und_path: str | None = None, und_config: dict | None = None,
                 gen_hidden_size: int | None = None, gen_intermediate_size: int | None = None,
                 max_text_len: int | None = None, trainable_patterns: Sequence[str] = ("gen.*",),
                 action_lr_multiplier: float = 5.0, image_mean: Sequence[float] = (0.5, 0.5, 0.5),
                 image_std: Sequence[float] = (0.5, 0.5, 0.5), init_seed: int = 0, max_batch: int = 64,
                 tokenizer_dir: str | None = None, cuda_graphs: bool = False, kv_layout: str = "expanded",
                 compile: bool = False, graph_buckets: Sequence[int] | str | None = None,
                 batched_vision_attention: bool = True, **_):
        from transformers import Qwen3VLConfig

        preset = get_size(size)
        self.size = size
        self.cameras = tuple(cameras.split(",")) if isinstance(cameras, str) else tuple(cameras)
        # Inference speed options (none changes the arithmetic; they change which kernels run):
        # - cuda_graphs: on a CUDA device the whole denoising loop is one CUDA graph per batch bucket (batches are
        #   padded up to the next bucket); `warmup()` captures every bucket up front (the server does so before
        #   /health answers), otherwise a bucket is captured on first use.
        # - kv_layout: the prefix K/V during denoising, "expanded" (repeated to all query heads once per
        #   observation: SDPA then runs without GQA, so a fused masked-attention kernel can take it) or "room"
        #   (kv heads only, SDPA with enable_gqa). Either way the action tokens' K/V go into free slots in place.
        # - compile: torch.compile of each generation block and of the understanding tower's norms and MLPs
        #   (fuses the elementwise work around the GEMMs); needs a working Inductor backend (Triton on GPUs).
        self.cuda_graphs = parse_bool(cuda_graphs, "cuda_graphs")
        if kv_layout not in ("expanded", "room"):
            raise UserError(f"kv_layout must be expanded or room, got {kv_layout!r}")
        self.kv_layout = kv_layout
        self.compile = parse_bool(compile, "compile")
        self._graphs: dict[tuple, Any] = {}
        self._graph_pool = None
        self._static: dict[str, Any] = {}
        self.horizon = int(horizon)
        self.env_action_dim = int(action_dim)
        self.state_dim = int(state_dim)
        self.num_inference_steps = int(num_inference_steps)
        self.device = torch.device(device)
        self.dtype = _dtype(dtype)
        self.max_text_len = int(max_text_len or preset.max_text_len)
        self.trainable_patterns = tuple(trainable_patterns)
        self.action_lr_multiplier = float(action_lr_multiplier)
        self.image_mean = tuple(float(v) for v in image_mean)
        self.image_std = tuple(float(v) for v in image_std)
        self.init_seed = int(init_seed)
        self.max_batch = int(max_batch)
        self.graph_buckets = _buckets(graph_buckets, self.max_batch)
        self.und_path = und_path
        pipe = as_action_pipeline(action_pipeline)
        try:
            self.model_action_dim = int(pipe.out_dim(self.env_action_dim))
        except ValueError as e:
            raise UserError(f"action pipeline does not fit action_dim={self.env_action_dim}: {e}") from None
        self._action_pipeline = pipe

        # ---- understanding tower (transformers Qwen3-VL; random weights from a config, or local weights)
        from transformers import Qwen3VLForConditionalGeneration, Qwen3VLModel

        if und_path is not None:
            if not Path(und_path).is_dir():
                raise UserError(f"und_path {und_path!r} is not a local directory (nothing is downloaded)")
            full = Qwen3VLForConditionalGeneration.from_pretrained(str(und_path), dtype=self.dtype,
                                                                   local_files_only=True)
            und = full.model
            del full
            qcfg = und.config
        else:
            qcfg = Qwen3VLConfig(**(und_config if und_config is not None else qwen3vl_config_dict(size)))
            qcfg._attn_implementation = "sdpa"
            und = None
        self.qwen_config = qcfg
        vc = qcfg.vision_config
        self.patch_size, self.merge, self.temporal = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
        self.image_size = int(image_size or preset.image_size)
        if self.image_size % (self.patch_size * self.merge):
            raise UserError(f"image_size {self.image_size} must be a multiple of patch_size*spatial_merge_size "
                            f"= {self.patch_size * self.merge}")
        g = self.image_size // self.patch_size
        self.tokens_per_image = (g // self.merge) ** 2
        tc = qcfg.text_config
        gen_hidden = int(gen_hidden_size or preset.gen_hidden or tc.hidden_size)
        gen_ffn = int(gen_intermediate_size or preset.gen_ffn or tc.intermediate_size)

        # a random-weight model for an accelerator is built on the meta device and initialized there (materialize):
        # a CPU build of a Cosmos3-sized model in fp32 would take minutes and tens of GB of host memory
        on_accel = und_path is None and self.device.type not in ("cpu", "meta")
        build_device = torch.device("meta") if on_accel else self.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed)
            with torch.device(build_device if build_device.type == "meta" else "cpu"):
                if und is None:
                    und = Qwen3VLModel(qcfg)
                gen = GenerationTower(tc, gen_hidden, gen_ffn, self.model_action_dim, self.state_dim)
                self.model = WamRefModel(und, gen)
            if build_device.type != "meta":
                torch.manual_seed(self.init_seed)  # same weights as a meta build + materialize()
                if und_path is None:
                    init_weights(self.model)
                else:
                    init_weights(self.model.gen)
        if build_device.type != "meta":
            self.model.to(device=self.device, dtype=self.dtype)
        self.model.eval()
        self.apply_trainable_patterns()
        # all images have one size here: the vision tower's attention runs as one call over all images instead of
        # transformers' one call per image (same arithmetic; see model.vision_attention_equal_length)
        self.batched_vision_attention = parse_bool(batched_vision_attention, "batched_vision_attention")
        if self.batched_vision_attention:
            try:
                use_batched_vision_attention(self.model.und)
            except Exception as e:  # noqa: BLE001 - a transformers without this hook: keep its per-image calls
                import warnings

                warnings.warn(f"wam-ref: batched vision attention unavailable ({e}); using transformers' own")
                self.batched_vision_attention = False
        if on_accel:
            self.materialize(self.device)

        if self.compile:
            self.enable_compile()
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer = load_tokenizer(tokenizer_dir or und_path, qcfg)
        self.gen_hidden, self.gen_ffn = gen_hidden, gen_ffn
        self.spec = PolicySpec(
            name="wam-ref",
            input=InputSpec(cameras=self.cameras, image_size=self.image_size, state_dim=self.state_dim, text=True),
            action=ActionSpec(dim=self.env_action_dim, horizon=self.horizon,
                              representation=f"model{self.model_action_dim}"),
            deterministic=True, trainable=True,
            extra={"size": size, "num_inference_steps": self.num_inference_steps,
                   "prefix_len": self.prefix_len, "model_action_dim": self.model_action_dim})

    # ------------------------------------------------------------------ trainer-facing interface
    @property
    def action_pipeline(self):
        """env actions <-> model actions (`forward` / `inverse`); settable (the trainer adds normalizer stats) as
        long as the model-space dimension stays the same."""
        return self._action_pipeline

    @action_pipeline.setter
    def action_pipeline(self, p) -> None:
        p = as_action_pipeline(p)
        try:
            d = int(p.out_dim(self.env_action_dim))
        except ValueError as e:
            raise UserError(f"action pipeline does not fit action_dim={self.env_action_dim}: {e}") from None
        if d != self.model_action_dim:
            raise UserError(f"action pipeline maps {self.env_action_dim}-D env actions to {d}-D, but this model was "
                            f"built for {self.model_action_dim}-D (pass the pipeline at construction)")
        self._action_pipeline = p

    @property
    def module(self) -> WamRefModel:
        return self.model

    def apply_trainable_patterns(self, patterns: Sequence[str] | None = None) -> None:
        """Parameters whose name matches a glob in `patterns` train; all others are frozen (requires_grad=False)."""
        if patterns is not None:
            self.trainable_patterns = tuple(patterns)
        for n, p in self.model.named_parameters():
            p.requires_grad_(any(fnmatch.fnmatchcase(n, pat) for pat in self.trainable_patterns))

    def trainable_parameter_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def fsdp_units(self) -> list[torch.nn.Module]:
        """Modules to `fully_shard` one by one, in order; the last one is the root (`module`).

        When the understanding tower's text layers train, they stay in the root's group: the generation tower
        reaches them through the prefix K/V (not through their outputs), so the per-layer pre-backward all-gather
        of FSDP2 would never fire for them and their backward would find the weights resharded."""
        und = self.model.und
        text_trains = any(p.requires_grad for p in und.language_model.layers.parameters())
        text = [] if text_trains else [*und.language_model.layers]
        return [*und.visual.blocks, *text, *self.model.gen.blocks, self.model]

    def lr_multipliers(self) -> dict[str, float]:
        """Glob over `module.named_parameters()` names -> learning-rate multiplier (first match wins)."""
        m = self.action_lr_multiplier
        return {"gen.action_in.*": m, "gen.action_out.*": m}

    def max_batch_size(self) -> int:
        return self.max_batch

    # ------------------------------------------------------------------ inputs
    @property
    def prefix_len(self) -> int:
        return len(self.cameras) * (self.tokens_per_image + 2) + self.max_text_len

    def pixel_values(self, images: Sequence[Any]) -> torch.Tensor:
        """HxWx3 uint8 images -> the vision tower's patches (sum of gh*gw, patch dim) on the policy's device, in its
        dtype. The uint8 images are uploaded as they are (4x fewer bytes than floats) and converted, resized when
        they are not image_size, normalized and patchified there, all images in one batch when they share a shape."""
        arrs = []
        for a in images:
            a = np.asarray(a)
            t = torch.as_tensor(a if a.flags.writeable else a.copy())   # decoded wire images are read-only views
            if t.ndim != 3 or t.shape[-1] != 3:
                raise UserError(f"wam-ref expects HxWx3 uint8 images, got shape {tuple(t.shape)}")
            arrs.append(t)
        if not arrs:
            return torch.zeros((0, 3 * self.temporal * self.patch_size ** 2), device=self.device, dtype=self.dtype)
        groups = [torch.stack(arrs)] if len({tuple(t.shape) for t in arrs}) == 1 else [t[None] for t in arrs]
        mean = torch.tensor(self.image_mean, device=self.device)[:, None, None]
        std = torch.tensor(self.image_std, device=self.device)[:, None, None]
        out = []
        for g in groups:
            x = g.to(self.device).permute(0, 3, 1, 2).float() / 255.0
            if x.shape[2:] != (self.image_size, self.image_size):
                x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False,
                                  antialias=True).clamp_(0.0, 1.0)
            out.append(patchify((x - mean) / std, self.patch_size, self.merge, self.temporal))
        return (out[0] if len(out) == 1 else torch.cat(out)).to(self.dtype)

    def prepare_inputs(self, images: dict[str, Any] | list[dict[str, Any]], tasks: Sequence[str],
                       states=None) -> dict[str, torch.Tensor]:
        """Model inputs for a batch. images: {camera: (B,H,W,3) uint8} or a list of per-observation dicts."""
        n = len(tasks)
        per_obs = images if isinstance(images, list) else [{c: images[c][i] for c in images} for i in range(n)]
        tok = self.tokenizer
        g = self.image_size // self.patch_size
        vis = []
        for cam in self.cameras:
            vis += [tok.vision_start_id] + [tok.image_id] * self.tokens_per_image + [tok.vision_end_id]
        text_ids, text_mask = tok.encode_fixed(list(tasks), self.max_text_len)
        ids = np.concatenate([np.tile(np.asarray(vis, np.int64), (n, 1)), text_ids], axis=1)
        mask = np.concatenate([np.ones((n, len(vis)), bool), text_mask], axis=1)
        imgs = []  # observation-major, camera-minor: the order of the image tokens in the prompts
        for i, obs_imgs in enumerate(per_obs):
            for cam in self.cameras:
                if cam not in obs_imgs:
                    raise UserError(f"wam-ref needs camera {cam!r}; observation {i} has {sorted(obs_imgs)}")
                imgs.append(obs_imgs[cam])
        ids_t = torch.from_numpy(ids)
        mask_t = torch.from_numpy(mask.astype(np.int64))
        out = {
            "input_ids": ids_t.to(self.device),
            "attention_mask": mask_t.to(self.device),
            "position_ids": self.position_ids(mask_t).to(self.device),
            "mm_token_type_ids": (ids_t == tok.image_id).to(torch.int32).to(self.device),
            "pixel_values": self.pixel_values(imgs),
            "image_grid_thw": torch.tensor([[1, g, g]] * (n * len(self.cameras)), dtype=torch.long,
                                           device=self.device),
        }
        if self.state_dim > 0:
            if states is None or any(s is None for s in states):
                raise UserError(f"wam-ref was built with state_dim={self.state_dim}: observations need a state")
            st = torch.as_tensor(np.stack([np.asarray(s, np.float32) for s in states]))
            if st.shape[-1] != self.state_dim:
                raise UserError(f"state has {st.shape[-1]} dims, the policy expects {self.state_dim}")
            out["state"] = st.to(self.device, self.dtype)
        return out

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """mRoPE positions (3, B, S) for prompts in this policy's layout, on the host, without a Python loop.

        Every prompt is [vision tokens per camera] + text right-padded to max_text_len, so a real token's position
        does not depend on the prompt: it is the position of the same slot in a prompt without padding (the
        template, computed once by transformers' own get_rope_index); padded slots get 0, as get_rope_index leaves
        them. tests/test_policy_wam_ref.py checks this against get_rope_index."""
        tpl = self._static.get("position_template")
        if tpl is None:
            tok = self.tokenizer
            g = self.image_size // self.patch_size
            ids = []
            for _ in self.cameras:
                ids += [tok.vision_start_id] + [tok.image_id] * self.tokens_per_image + [tok.vision_end_id]
            ids = torch.tensor([ids + [tok.vision_end_id] * self.max_text_len])  # any text id: only types matter
            types = (ids == tok.image_id).to(torch.int32)
            grid = torch.tensor([[1, g, g]] * len(self.cameras), dtype=torch.long)
            tpl, _ = self.model.und.get_rope_index(ids, types, image_grid_thw=grid,
                                                   attention_mask=torch.ones_like(ids))
            tpl = self._static["position_template"] = tpl[:, 0].to("cpu")
        m = attention_mask.to(torch.long).cpu()
        return tpl[:, None, :] * m[None]

    # ------------------------------------------------------------------ inference
    def noise(self, seeds: Sequence[int]) -> torch.Tensor:
        """(N, horizon, model_action_dim) float32 noise; row i comes from its own generator seeded by seeds[i]."""
        rows = [torch.randn((self.horizon, self.model_action_dim),
                            generator=torch.Generator().manual_seed(int(s) % (2 ** 63))) for s in seeds]
        return torch.stack(rows) if rows else torch.zeros((0, self.horizon, self.model_action_dim))

    @torch.no_grad()
    def sample(self, inputs: dict[str, torch.Tensor], seeds: Sequence[int],
               num_inference_steps: int | None = None) -> torch.Tensor:
        """Model-space action chunks (N, horizon, model_action_dim) float32: one prefix pass, then Euler steps."""
        steps = int(num_inference_steps or self.num_inference_steps)
        m = self.model
        prefix: Prefix = m.encode_prefix(inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"],
                                         inputs["pixel_values"], inputs["image_grid_thw"], inputs.get("position_ids"))
        x = self.noise(seeds).to(self.device, torch.float32)
        if self.cuda_graphs and self.device.type == "cuda":
            return self._sample_graphed(prefix, x, inputs.get("state"), steps)
        room = prefix.with_room(self.gen_tokens, self._kv_heads())
        return m.gen.denoise(room, x, inputs.get("state"), steps)

    @property
    def gen_tokens(self) -> int:
        """Tokens of the generation tower: the action chunk (+ one state token)."""
        return self.horizon + (1 if self.state_dim > 0 else 0)

    def _kv_heads(self) -> int:
        tc = self.qwen_config.text_config
        return tc.num_attention_heads if self.kv_layout == "expanded" else tc.num_key_value_heads

    def _graph_bucket(self, n: int) -> int:
        for b in self.graph_buckets:
            if b >= n:
                return b
        return n

    def _sample_graphed(self, prefix: Prefix, x: torch.Tensor, state, steps: int) -> torch.Tensor:
        """The Euler loop replayed from a CUDA graph: the batch is padded to a bucket (`graph_buckets`), its inputs
        copied into static buffers shared by every bucket's graph. Same arithmetic as the eager loop; which GPU
        kernels run (and so the last bits) can differ from eager and between buckets."""
        n, s = x.shape[0], prefix.key_mask.shape[1]
        bucket = self._graph_bucket(n)
        key = (bucket, steps, s, self.kv_layout)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _DenoiseGraph(self, bucket, steps, s)
        return g.run(prefix, x, state)

    def warmup(self, max_batch: int | None = None) -> dict[str, float]:
        """Do the one-off work before serving: with cuda_graphs on a CUDA device, capture the denoising graph of
        every bucket up to `max_batch` (compiling first when compile=true); otherwise one predict of a single
        observation (library handles, kernel selection). Returns seconds per bucket."""
        top = min(int(max_batch or self.max_batch), self.max_batch)
        sizes = [b for b in self.graph_buckets if b <= top] if (self.cuda_graphs and self.device.type == "cuda") \
            else [1]
        g = np.random.default_rng(0)
        side = self.image_size
        out = {}
        for b in sizes:
            obs = [Observation({c: g.integers(0, 256, (side, side, 3), dtype=np.uint8) for c in self.cameras},
                               np.zeros(self.state_dim, np.float32) if self.state_dim > 0 else None, "warm up")
                   for _ in range(b)]
            t0 = time.perf_counter()
            self.predict(obs, list(range(b)))
            out[str(b)] = time.perf_counter() - t0
        return out

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph, their memory pool and static buffers (e.g. before changing kv_layout)."""
        self._graphs.clear()
        self._graph_pool = None
        for k in [k for k in self._static if isinstance(k, tuple) and k[0] == "graph_buffers"]:
            del self._static[k]

    def enable_compile(self) -> None:
        """What compile=true does (also callable after construction): torch.compile (Inductor) of the generation
        blocks and of the understanding tower's RMSNorms and MLPs, in place (`nn.Module.compile`). Dynamo's
        automatic dynamic shapes: the second batch size seen recompiles with a symbolic batch dimension."""
        import torch._dynamo

        self.compile = True
        for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                  "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, k):
                setattr(torch._dynamo.config, k, max(getattr(torch._dynamo.config, k), 256))
        for blk in self.model.gen.blocks:
            blk.compiled = True   # its two pure functions, compiled once for all blocks (see GenBlock)
        for name, mod in self.model.und.named_modules():
            kind = type(mod).__name__
            if kind.endswith("RMSNorm") or kind.endswith("TextMLP") or kind.endswith("VisionMLP"):
                mod.compile()

    def predict(self, observations: Sequence[Observation], seeds: Sequence[int]) -> np.ndarray:
        if len(observations) != len(seeds):
            raise UserError(f"predict got {len(observations)} observations and {len(seeds)} seeds")
        if self.device.type == "meta":
            raise UserError("this wam-ref was built on the meta device: call materialize(device) first")
        out = np.zeros((len(observations), self.horizon, self.env_action_dim), np.float32)
        for s in range(0, len(observations), self.max_batch):
            obs = observations[s:s + self.max_batch]
            inputs = self.prepare_inputs([o.images for o in obs], [o.task for o in obs],
                                         [o.state for o in obs] if self.state_dim > 0 else None)
            a = self.sample(inputs, seeds[s:s + self.max_batch]).cpu().numpy()
            env = np.asarray(self.action_pipeline.inverse(a), np.float32)
            out[s:s + len(obs)] = env
        return out

    # ------------------------------------------------------------------ training
    def sft_loss(self, batch: dict[str, Any]):
        """Flow-matching loss on a collated batch (actions already in model space: pipeline.forward applied).

        Noise and t come from torch's global RNG (the trainer seeds it per rank). Goes through `module.__call__`
        so an FSDP root wrapped around `module` sees the call."""
        tasks = list(batch["task"])
        inputs = self.prepare_inputs(batch["images"], tasks, batch.get("state") if self.state_dim > 0 else None)
        actions = torch.as_tensor(np.asarray(batch["actions"], np.float32) if not torch.is_tensor(batch["actions"])
                                  else batch["actions"]).to(self.device, torch.float32)
        if actions.shape[1:] != (self.horizon, self.model_action_dim):
            raise UserError(f"batch actions have shape {tuple(actions.shape)}; the policy expects "
                            f"(B, {self.horizon}, {self.model_action_dim}) in model space")
        mask = batch.get("action_mask")
        mask = (torch.ones(actions.shape[:2], dtype=torch.bool) if mask is None
                else torch.as_tensor(np.asarray(mask) if not torch.is_tensor(mask) else mask)).to(self.device)
        b = actions.shape[0]
        noise = torch.randn(actions.shape, device=self.device)
        t = torch.sigmoid(torch.randn((b,), device=self.device))   # logit-normal(0, 1)
        per_sample = self.model(**inputs, actions=actions, action_mask=mask, noise=noise, t=t)
        loss = per_sample.mean()
        return loss, {"loss": float(loss.detach()), "t_mean": float(t.mean())}

    # ------------------------------------------------------------------ export / loading
    def export_config(self) -> dict[str, Any]:
        """Constructor kwargs that rebuild this policy's shape (weights come from model.safetensors)."""
        return {
            "size": self.size, "action_dim": self.env_action_dim, "horizon": self.horizon,
            "cameras": list(self.cameras), "image_size": self.image_size, "state_dim": self.state_dim,
            "num_inference_steps": self.num_inference_steps, "dtype": _dtype_name(self.dtype),
            "und_config": self.qwen_config.to_dict(), "gen_hidden_size": self.gen_hidden,
            "gen_intermediate_size": self.gen_ffn, "max_text_len": self.max_text_len,
            "trainable_patterns": list(self.trainable_patterns), "action_lr_multiplier": self.action_lr_multiplier,
            "image_mean": list(self.image_mean), "image_std": list(self.image_std), "max_batch": self.max_batch,
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

    def materialize(self, device="cuda", dtype=None) -> "WamRefPolicy":
        """Meta-built model -> real tensors on `device` (`to_empty` + deterministic init, rotary buffers recomputed)."""
        self.device = torch.device(device)
        if dtype is not None:
            self.dtype = _dtype(dtype)
        self.model.to_empty(device=self.device)
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(self.init_seed)
            init_weights(self.model)
        self.model.to(dtype=self.dtype)
        self.apply_trainable_patterns()
        return self

    # ------------------------------------------------------------------ sizes and cost
    def num_parameters(self) -> dict[str, int]:
        und, gen = self.model.und, self.model.gen
        count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        return {"total": count(self.model), "und": count(und), "und_vision": count(und.visual),
                "und_text": count(und.language_model), "und_text_embed": und.language_model.embed_tokens.weight.numel(),
                "gen": count(gen), "trainable": sum(p.numel() for p in self.model.parameters() if p.requires_grad)}

    def flops_per_observation(self, num_inference_steps: int | None = None, prefix_len: int | None = None) -> dict:
        """Forward FLOPs per observation (2 per multiply-add; matmuls + attention scores), one prefix pass plus
        `num_inference_steps` generation-tower passes over the action (+state) tokens."""
        steps = int(num_inference_steps or self.num_inference_steps)
        s = int(prefix_len or self.prefix_len)
        tc = self.qwen_config.text_config
        L, nh = tc.num_hidden_layers, tc.num_attention_heads
        hd = head_dim_of(tc)
        und = self.model.und
        layer_params = sum(p.numel() for p in und.language_model.layers.parameters())
        vis_params = sum(p.numel() for n, p in und.visual.named_parameters() if "pos_embed" not in n)
        patches = len(self.cameras) * (self.image_size // self.patch_size) ** 2
        vis = 2 * vis_params * patches + 4 * patches * (patches // len(self.cameras)) * und.visual.config.hidden_size \
            * und.visual.config.depth
        und_f = 2 * layer_params * s + 2 * s * s * nh * hd * L  # causal: half of 4*s^2*nh*hd
        n = self.horizon + (1 if self.state_dim > 0 else 0)
        gen_params = sum(p.numel() for p in self.model.gen.blocks.parameters())
        gen_step = 2 * gen_params * n + 4 * n * (s + n) * nh * hd * L
        total = vis + und_f + steps * gen_step
        return {"vision": float(vis), "und_prefix": float(und_f), "gen_per_step": float(gen_step),
                "steps": steps, "prefix_len": s, "total": float(total)}


class _DenoiseGraph:
    """One captured CUDA graph of the whole denoising loop (`GenerationTower.denoise`) for one (bucket, steps, S).

    Its inputs live in static buffers that every bucket's graph shares (views of the first `bucket` rows of one
    max-size set, so memory does not grow with the number of buckets); the graphs share one memory pool too, which
    is safe because they never run at the same time and leave nothing alive in it (the result is copied out)."""

    def __init__(self, pol: "WamRefPolicy", bucket: int, steps: int, s: int):
        m = pol.model
        self.s, self.steps, self.bucket = s, steps, bucket
        st = _static_buffers(pol, s)
        self.keys = [k[:bucket] for k in st["keys"]]
        self.values = [v[:bucket] for v in st["values"]]
        self.key_mask, self.next_pos = st["key_mask"][:bucket], st["next_pos"][:bucket]
        self.x, self.out = st["x"][:bucket], st["out"][:bucket]
        self.state = st["state"][:bucket] if st["state"] is not None else None
        self.prefix = Prefix(self.keys, self.values, self.key_mask, self.next_pos)
        dev = pol.device

        def loop():
            self.out.copy_(m.gen.denoise(self.prefix, self.x, self.state, steps))

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            loop()  # warm-up outside the capture (library handles, kernel selection, compilation)
        torch.cuda.current_stream(dev).wait_stream(side)
        if pol._graph_pool is None:
            pol._graph_pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pol._graph_pool):
            loop()

    def run(self, prefix: Prefix, x: torch.Tensor, state) -> torch.Tensor:
        # rows past n keep whatever they held (finite values from an earlier call or the initial zeros/ones):
        # every row is computed independently, so they cannot change rows < n
        n = x.shape[0]
        for dsts, srcs in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for dst, src in zip(dsts, srcs):
                write_heads(dst, src, 0)
        self.key_mask[:n, :self.s].copy_(prefix.key_mask)
        self.next_pos[:n].copy_(prefix.next_pos)
        self.x[:n].copy_(x)
        if self.state is not None:
            self.state[:n].copy_(state.to(self.state.dtype))
        self.graph.replay()
        return self.out[:n].clone()


def _static_buffers(pol: "WamRefPolicy", s: int) -> dict[str, Any]:
    """The graphs' input/output buffers at the largest bucket (allocated once per prefix length and layout)."""
    key = ("graph_buffers", s, pol.kv_layout)
    st = pol._static.get(key)
    if st is not None:
        return st
    top = max(pol.graph_buckets)
    hd = head_dim_of(pol.qwen_config.text_config)
    heads, n, dev, dt = pol._kv_heads(), pol.gen_tokens, pol.device, pol.dtype
    L = len(pol.model.gen.blocks)
    st = {"keys": [torch.zeros(top, heads, s + n, hd, device=dev, dtype=dt) for _ in range(L)],
          "values": [torch.zeros(top, heads, s + n, hd, device=dev, dtype=dt) for _ in range(L)],
          "key_mask": torch.ones(top, s + n, dtype=torch.bool, device=dev),
          "next_pos": torch.zeros(top, dtype=torch.long, device=dev),
          "x": torch.zeros(top, pol.horizon, pol.model_action_dim, device=dev, dtype=torch.float32),
          "out": torch.zeros(top, pol.horizon, pol.model_action_dim, device=dev, dtype=torch.float32),
          "state": torch.zeros(top, pol.state_dim, device=dev, dtype=dt) if pol.state_dim > 0 else None}
    pol._static[key] = st
    return st
