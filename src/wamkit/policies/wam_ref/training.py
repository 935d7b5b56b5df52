"""wam-ref's trainer-facing interface (what wamkit.train.trainer calls: `module`, `fsdp_units`, `lr_multipliers`,
`sft_loss`, `action_pipeline`, meta-device init after sharding, trainable-parameter globs), as a mixin of
`WamRefPolicy`: the policy class holds construction and inference, this one what training needs on top."""

from __future__ import annotations

import fnmatch
from typing import Any, Sequence

import numpy as np
import torch

from wamkit.core.errors import UserError
from wamkit.policies.wam_ref.build import init_on
from wamkit.policies.wam_ref.config import as_action_pipeline, model_action_dim
from wamkit.policies.wam_ref.model import WamRefModel


class WamRefTraining:
    """Mixin of WamRefPolicy (uses its model, config, placement, action dimensions and prepare_inputs)."""

    @property
    def action_pipeline(self):
        """env actions <-> model actions (`forward` / `inverse`); settable (the trainer adds normalizer stats) as
        long as the model-space dimension stays the same."""
        return self._action_pipeline

    @action_pipeline.setter
    def action_pipeline(self, p) -> None:
        p = as_action_pipeline(p)
        d = model_action_dim(p, self.env_action_dim)
        if d != self.model_action_dim:
            raise UserError(f"action pipeline maps {self.env_action_dim}-D env actions to {d}-D, but this model was "
                            f"built for {self.model_action_dim}-D (pass the pipeline at construction)")
        self._action_pipeline = p

    @property
    def module(self) -> WamRefModel:
        return self.model

    @classmethod
    def can_init_after_sharding(cls, args: dict[str, Any]) -> bool:
        """Whether the trainer may build this policy on the meta device and `init_weights` it after sharding:
        random weights only (und_path loads real weights at construction)."""
        return args.get("und_path") is None

    def init_weights(self, device) -> None:
        """Trainer-facing: initialize a meta-built model that `parallelize` has sharded, on `device` (each rank keeps
        its shards; same weights as an unsharded build on that device type). requires_grad is left as it is."""
        self.placement.device = torch.device(device)
        init_on(self.model, self.device, self.config.init_seed, round_to=self.dtype)

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
        m = self.config.action_lr_multiplier
        return {"gen.action_in.*": m, "gen.action_out.*": m}

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
        # prompts in the static layout: the prefix without host syncs (model.encode_prefix_static), its vision
        # geometry computed here first (once per batch size, host work) so that a compiled forward finds it cached
        static = self.model.image_slots is not None
        if static:
            self.model.static_vision_kwargs(b, inputs["input_ids"].device)
        per_sample = self.model(**inputs, actions=actions, action_mask=mask, noise=noise, t=t, static_prefix=static)
        loss = per_sample.mean()
        # 0-d tensors, not floats: reading them here would stop the host after the forward every step (the trainer
        # sums tensor metrics on the device and reads them once per log window)
        return loss, {"loss": loss.detach(), "t_mean": t.mean().detach()}
