"""Training samples over a LeRobot v3 dataset, their collate function, and a resumable sharded sampler.

    ds = LeRobotDataset(root, cameras=["image", "wrist_image"], check_fps=10)
    samples = TrainingSamples(ds, horizon=16, cameras=["image", "wrist_image"], image_size=256,
                              action_pipeline=policy.action_pipeline)
    sampler = ResumableShardedSampler(len(samples), num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(samples, batch_size=32, sampler=sampler, collate_fn=collate, num_workers=2)

Batch (docs/CONTRACTS.md): {"images": {cam: uint8 (B,H,W,3)}, "state": float32 (B,S) (when state_key is set),
"task": list[str], "actions": float32 (B,horizon,D'), "action_mask": bool (B,horizon)}.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch

from wamkit.data.lerobot import CAMERA_PREFIX, LeRobotDataset
from wamkit.data.transforms import ActionPipeline


def resize_uint8(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (h, w, 3), bilinear with antialiasing (PIL); identity when the size matches."""
    h, w = size
    if img.shape[0] == h and img.shape[1] == w:
        return img
    from PIL import Image

    return np.array(Image.fromarray(img).resize((w, h), Image.BILINEAR))


def _size(image_size) -> tuple[int, int] | None:
    if image_size is None:
        return None
    if isinstance(image_size, int):
        return (image_size, image_size)
    h, w = image_size
    return (int(h), int(w))


class TrainingSamples(torch.utils.data.Dataset):
    """Item i: the observation at row i and the action chunk starting there.

    cameras: short names (`image`) or feature keys (`observation.images.image`); items use the short names.
    image_size: int or (H, W) to resize to (uint8), None keeps the dataset's size.
    action_pipeline: applied to the (horizon, D) chunk (e.g. rot6d + quantile normalization); None = raw actions.
    state_key: proprio feature to return as "state" (None: no state).
    """

    def __init__(self, dataset: LeRobotDataset, horizon: int, cameras: Sequence[str] | None = None,
                 image_size: int | tuple[int, int] | None = None, action_pipeline: ActionPipeline | None = None,
                 state_key: str | None = "observation.state", action_key: str = "action"):
        self.dataset = dataset
        self.horizon = int(horizon)
        cams = list(cameras) if cameras is not None else dataset.cameras
        self.camera_keys = [c if c in dataset.features else CAMERA_PREFIX + c for c in cams]
        self.camera_names = [k[len(CAMERA_PREFIX):] if k.startswith(CAMERA_PREFIX) else k for k in self.camera_keys]
        missing = [k for k in self.camera_keys if k not in dataset.camera_keys]
        if missing:
            from wamkit.data.errors import FeatureMissingError

            raise FeatureMissingError(f"{dataset.root}: camera {missing[0]!r} not loaded by the dataset; loaded: "
                                      f"{', '.join(dataset.cameras)}")
        self.image_size = _size(image_size)
        self.action_pipeline = action_pipeline
        self.state_key = state_key
        self.action_key = action_key
        dataset.column(action_key)  # raises FeatureMissingError when absent
        if state_key is not None:
            dataset.column(state_key)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ds = self.dataset
        i = int(i)
        images = {}
        for name, key in zip(self.camera_names, self.camera_keys):
            img = ds.get_frame(i, key)
            if self.image_size is not None:
                img = resize_uint8(img, self.image_size)
            images[name] = torch.from_numpy(np.ascontiguousarray(img))
        actions, mask = ds.get_action_chunk(i, self.horizon, key=self.action_key)
        if self.action_pipeline is not None:
            actions = self.action_pipeline.forward(actions)
        out = {
            "images": images,
            "task": ds.tasks.get(int(ds.column("task_index")[i]), "") if "task_index" in ds._columns else "",
            "actions": torch.from_numpy(np.asarray(actions, dtype=np.float32)),
            "action_mask": torch.from_numpy(np.asarray(mask, dtype=bool)),
            "index": i,
        }
        if self.state_key is not None:
            out["state"] = torch.from_numpy(np.array(ds.column(self.state_key)[i], dtype=np.float32).reshape(-1))
        return out


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack TrainingSamples items into the training batch of docs/CONTRACTS.md."""
    batch: dict[str, Any] = {
        "images": {cam: torch.stack([it["images"][cam] for it in items]) for cam in items[0]["images"]},
        "task": [it["task"] for it in items],
        "actions": torch.stack([it["actions"] for it in items]),
        "action_mask": torch.stack([it["action_mask"] for it in items]),
    }
    if "state" in items[0]:
        batch["state"] = torch.stack([it["state"] for it in items])
    if "index" in items[0]:
        batch["index"] = torch.tensor([it["index"] for it in items], dtype=torch.int64)
    return batch


class ResumableShardedSampler(torch.utils.data.Sampler[int]):
    """Shuffled (per epoch, from seed + epoch), sharded across data-parallel ranks, resumable mid-epoch.

    Every rank draws the same permutation and takes positions rank, rank + R, rank + 2R, ...; drop_last trims the
    permutation to a multiple of R (ranks disjoint, equal length), otherwise it is padded by wrapping around.
    `position` counts indices handed out by this rank in the current epoch. `state_dict()` -> {epoch, position, ...};
    `load_state_dict()` makes the next iteration continue at exactly that position. With DataLoader workers and
    prefetching, the sampler runs ahead of the training step: save `state_dict(position=consumed_samples)` with the
    number of samples the trainer actually consumed on this rank.
    """

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True):
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"bad rank {rank} for num_replicas {num_replicas}")
        self.n = int(n)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.position = 0
        if self.drop_last:
            self.num_samples = self.n // self.num_replicas
        else:
            self.num_samples = -(-self.n // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.position = 0

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch (the full list, ignoring position)."""
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        else:
            perm = np.arange(self.n)
        if self.total_size <= self.n:
            perm = perm[: self.total_size]
        elif self.n > 0:
            perm = np.concatenate([perm, np.resize(perm, self.total_size - self.n)])
        return perm[self.rank: self.total_size: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        idx = self.indices()
        start = self.position
        for j in range(start, len(idx)):
            self.position = j + 1
            yield int(idx[j])
        # epoch finished: the next iteration starts the next epoch unless set_epoch says otherwise
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.num_samples - self.position

    def state_dict(self, position: int | None = None) -> dict:
        return {"epoch": self.epoch, "position": int(self.position if position is None else position),
                "seed": self.seed, "n": self.n, "num_replicas": self.num_replicas, "rank": self.rank,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("n", self.n)) != self.n:
            raise ValueError(f"sampler state is for a dataset of {state['n']} samples, this one has {self.n}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
