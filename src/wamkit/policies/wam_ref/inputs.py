"""wam-ref's input processor: observations (HxWx3 uint8 images per camera, task text, optional state) -> the
understanding tower's inputs (token ids, attention mask, mRoPE positions, image patches) on the model's device.

Every prompt has one layout: `[<vision_start> <image_pad>*tokens_per_image <vision_end>]` per camera, then the task
text right-padded to `max_text_len`, so every observation's prefix has the same length (`prefix_len`) and an
observation's inputs never depend on its batch mates.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from wamkit.core.errors import UserError
from wamkit.policies.wam_ref.config import Placement


def patchify(img: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """(3, H, W) or (N, 3, H, W) normalized images -> (N*gh*gw, 3*temporal*patch*patch) in Qwen-VL's patch order
    (image after image).

    Patches are grouped by spatial-merge window (merge x merge neighbours contiguous), channels outermost inside a
    patch, and the single frame repeated `temporal` times (what Qwen3-VL's image processor does for still images);
    this is the layout `Qwen3VLVisionPatchEmbed` (Conv3d over (C, T, p, p)) and the patch merger expect."""
    return lay_out_patches(patch_view(img[None] if img.ndim == 3 else img, patch, merge), temporal)


def patch_view(x: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
    """(N, C, H, W) images, any strides (a permuted NHWC tensor too) -> a view (N, gh/m, gw/m, m, m, C, p, p) in
    patchify's order: nothing is copied, so per-channel work on it (broadcast over (C, 1, 1)) touches each pixel
    once."""
    n, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    x = x.reshape(n, c, gh // merge, merge, patch, gw // merge, merge, patch)
    return x.permute(0, 2, 5, 3, 6, 1, 4, 7)


def lay_out_patches(v: torch.Tensor, temporal: int) -> torch.Tensor:
    """patch_view's (N, gh/m, gw/m, m, m, C, p, p) -> (N*gh*gw, C*temporal*p*p), the frame repeated `temporal`
    times: the one copy."""
    n, a, b, m, _, c, p, _ = v.shape
    v = v.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, temporal, -1, -1)
    return v.reshape(n * a * b * m * m, c * temporal * p * p)


class InputProcessor:
    """Builds model inputs for a batch (`prepare`); holds the prompt layout and the image geometry.

    rope_index: the understanding tower's `get_rope_index` (called once, for the position template); may be set
    after construction, once the model exists."""

    def __init__(self, *, cameras: Sequence[str], image_size: int, patch_size: int, merge: int, temporal: int,
                 max_text_len: int, state_dim: int, image_mean: Sequence[float], image_std: Sequence[float],
                 tokenizer, placement: Placement, rope_index: Callable | None = None):
        self.cameras = tuple(cameras)
        self.patch_size, self.merge, self.temporal = patch_size, merge, temporal
        self.image_size = int(image_size)
        if self.image_size % (self.patch_size * self.merge):
            raise UserError(f"image_size {self.image_size} must be a multiple of patch_size*spatial_merge_size "
                            f"= {self.patch_size * self.merge}")
        self.tokens_per_image = (self.image_size // self.patch_size // self.merge) ** 2
        self.max_text_len, self.state_dim = int(max_text_len), int(state_dim)
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.tokenizer = tokenizer
        self.rope_index = rope_index
        self._position_template: torch.Tensor | None = None
        self._norm: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # device -> (mean, std), uploaded once
        self.placement = placement

    @staticmethod
    def _upload(t: torch.Tensor, device) -> torch.Tensor:
        """A host tensor to `device` without stalling the host on the GPU: a plain `.to(cuda)` of pageable memory
        waits for every kernel queued before it (the training step's inputs were 4 of its 39 host syncs); from
        pinned memory the copy is queued like a kernel."""
        device = torch.device(device)
        if device.type != "cuda" or t.device.type != "cpu":
            return t.to(device)
        return t.pin_memory().to(device, non_blocking=True)

    @property
    def prefix_len(self) -> int:
        return len(self.cameras) * (self.tokens_per_image + 2) + self.max_text_len

    @property
    def image_slots(self) -> list[tuple[int, int]]:
        """(start, length) of each camera's image tokens in every prompt, in camera order."""
        return [(c * (self.tokens_per_image + 2) + 1, self.tokens_per_image) for c in range(len(self.cameras))]

    def _vision_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = []
        for _ in self.cameras:
            ids += [tok.vision_start_id] + [tok.image_id] * self.tokens_per_image + [tok.vision_end_id]
        return ids

    def pixel_values(self, images: Sequence[Any]) -> torch.Tensor:
        """HxWx3 uint8 images -> the vision tower's patches (sum of gh*gw, patch dim) on the policy's device, in its
        dtype. The uint8 images are uploaded as they are (4x fewer bytes than floats) and converted, resized when
        they are not image_size, normalized and patchified there, all images in one batch when they share a shape."""
        device, dtype = self.placement.device, self.placement.dtype
        if torch.is_tensor(images) and images.ndim == 4:   # (N, H, W, 3): a training batch's images, already stacked
            if images.shape[-1] != 3:
                raise UserError(f"wam-ref expects HxWx3 uint8 images, got shape {tuple(images.shape[1:])}")
            return self._patches([images], device, dtype)
        arrs = []
        for a in images:
            if torch.is_tensor(a):   # a training batch's pinned host tensor, or already on the device
                t = a
            else:
                a = np.asarray(a)
                t = torch.as_tensor(a if a.flags.writeable else a.copy())   # decoded wire images: read-only views
            if t.ndim != 3 or t.shape[-1] != 3:
                raise UserError(f"wam-ref expects HxWx3 uint8 images, got shape {tuple(t.shape)}")
            arrs.append(t)
        if not arrs:
            return torch.zeros((0, 3 * self.temporal * self.patch_size ** 2), device=device, dtype=dtype)
        groups = [torch.stack(arrs)] if len({tuple(t.shape) for t in arrs}) == 1 else [t[None] for t in arrs]
        return self._patches(groups, device, dtype)

    def _patches(self, groups, device, dtype) -> torch.Tensor:
        """(N, H, W, 3) uint8 groups -> patches (see pixel_values)."""
        key = str(device)
        if key not in self._norm:
            self._norm[key] = (torch.tensor(self.image_mean, device=device)[:, None, None],
                               torch.tensor(self.image_std, device=device)[:, None, None])
        mean, std = self._norm[key]
        out = []
        for g in groups:
            x = g.to(device, non_blocking=True)
            if tuple(x.shape[1:3]) == (self.image_size, self.image_size):
                out.append(self._patches_at_size(x, mean, std, dtype))
                continue
            x = x.permute(0, 3, 1, 2).float() / 255.0
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False,
                              antialias=True).clamp_(0.0, 1.0)
            out.append(patchify((x - mean) / std, self.patch_size, self.merge, self.temporal).to(dtype))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _patches_at_size(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype) -> torch.Tensor:
        """(N, S, S, 3) uint8 images already image_size -> patches, the same values as the resizing path (the
        same float32 operations per element, here in place) with less memory: the patch order is a view of the
        uint8 images (patch_view), the temporal repeat comes after the cast to `dtype`, and one copy lays the
        patches out. The only float32 tensor is one copy of the pixels (batch 64 x 2 cameras of 256 px: 100 MB,
        where the resizing path's chain allocates ~700 MB)."""
        v = patch_view(x.permute(0, 3, 1, 2), self.patch_size, self.merge)
        # copy=True: a float32 input (a caller's own tensor) must not be normalized in place
        y = v.to(torch.float32, copy=True).div_(255.0).sub_(mean).div_(std).to(dtype)
        return lay_out_patches(y, self.temporal)

    def prepare(self, images: dict[str, Any] | list[dict[str, Any]], tasks: Sequence[str],
                states=None) -> dict[str, torch.Tensor]:
        """Model inputs for a batch. images: {camera: (B,H,W,3) uint8} or a list of per-observation dicts."""
        device = self.placement.device
        n = len(tasks)
        batched = (not isinstance(images, list) and all(torch.is_tensor(images.get(c)) for c in self.cameras)
                   and len({tuple(images[c].shape) for c in self.cameras}) == 1)   # mixed sizes: per observation
        per_obs = images if isinstance(images, list) else None if batched else \
            [{c: images[c][i] for c in images} for i in range(n)]
        tok = self.tokenizer
        g = self.image_size // self.patch_size
        vis = self._vision_ids()
        text_ids, text_mask = tok.encode_fixed(list(tasks), self.max_text_len)
        ids = np.concatenate([np.tile(np.asarray(vis, np.int64), (n, 1)), text_ids], axis=1)
        mask = np.concatenate([np.ones((n, len(vis)), bool), text_mask], axis=1)
        if batched:   # {camera: (B, H, W, 3)} tensors (a training batch): one stack, observation-major camera-minor
            imgs = torch.stack([images[c] for c in self.cameras], 1).flatten(0, 1)
        else:
            imgs = []  # observation-major, camera-minor: the order of the image tokens in the prompts
            for i, obs_imgs in enumerate(per_obs):
                for cam in self.cameras:
                    if cam not in obs_imgs:
                        raise UserError(f"wam-ref needs camera {cam!r}; observation {i} has {sorted(obs_imgs)}")
                    imgs.append(obs_imgs[cam])
        ids_t = torch.from_numpy(ids)
        mask_t = torch.from_numpy(mask.astype(np.int64))
        up = self._upload
        out = {
            "input_ids": up(ids_t, device),
            "attention_mask": up(mask_t, device),
            "position_ids": up(self.position_ids(mask_t), device),
            "mm_token_type_ids": up((ids_t == tok.image_id).to(torch.int32), device),
            "pixel_values": self.pixel_values(imgs),
            "image_grid_thw": up(torch.tensor([[1, g, g]] * (n * len(self.cameras)), dtype=torch.long), device),
        }
        if self.state_dim > 0:
            if states is None or (not torch.is_tensor(states) and any(s is None for s in states)):
                raise UserError(f"wam-ref was built with state_dim={self.state_dim}: observations need a state")
            st = states if torch.is_tensor(states) else torch.as_tensor(np.stack([np.asarray(s, np.float32)
                                                                                   for s in states]))
            if st.shape[-1] != self.state_dim:
                raise UserError(f"state has {st.shape[-1]} dims, the policy expects {self.state_dim}")
            out["state"] = st.to(device, self.placement.dtype)
        return out

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """mRoPE positions (3, B, S) for prompts in this layout, on the host, without a Python loop.

        Every prompt is [vision tokens per camera] + text right-padded to max_text_len, so a real token's position
        does not depend on the prompt: it is the position of the same slot in a prompt without padding (the
        template, computed once by transformers' own get_rope_index); padded slots get 0, as get_rope_index leaves
        them. tests/test_policy_wam_ref.py checks this against get_rope_index."""
        tpl = self._position_template
        if tpl is None:
            tok = self.tokenizer
            g = self.image_size // self.patch_size
            ids = torch.tensor([self._vision_ids() + [tok.vision_end_id] * self.max_text_len])  # only types matter
            types = (ids == tok.image_id).to(torch.int32)
            grid = torch.tensor([[1, g, g]] * len(self.cameras), dtype=torch.long)
            tpl, _ = self.rope_index(ids, types, image_grid_thw=grid, attention_mask=torch.ones_like(ids))
            tpl = self._position_template = tpl[:, 0].to("cpu")
        m = attention_mask.to(torch.long).cpu()
        return tpl[:, None, :] * m[None]
