"""TrainingSamples / collate batch format, ResumableShardedSampler resume and sharding, data CLI."""

from pathlib import Path

import numpy as np
import pytest
import torch

from wamkit.data.lerobot import LeRobotDataset
from wamkit.data.samples import ResumableShardedSampler, TrainingSamples, collate
from wamkit.data.transforms import ActionPipeline, QuantileNormalizeStep, Rot6dStep, compute_action_stats

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot_v3_libero_tiny"


def test_training_batch_format():
    ds = LeRobotDataset(FIXTURE, check_fps=10)
    st = compute_action_stats(ds, horizon=16, pipeline_before_norm=ActionPipeline([Rot6dStep()]))
    pipe = ActionPipeline([Rot6dStep(), QuantileNormalizeStep(st["q01"], st["q99"])])
    samples = TrainingSamples(ds, horizon=16, cameras=["image", "wrist_image"], image_size=96, action_pipeline=pipe)
    loader = torch.utils.data.DataLoader(samples, batch_size=4, collate_fn=collate,
                                         sampler=ResumableShardedSampler(len(samples), seed=0))
    b = next(iter(loader))
    assert set(b["images"]) == {"image", "wrist_image"}
    assert b["images"]["image"].dtype == torch.uint8 and tuple(b["images"]["image"].shape) == (4, 96, 96, 3)
    assert b["state"].dtype == torch.float32 and tuple(b["state"].shape) == (4, 8)
    assert b["actions"].dtype == torch.float32 and tuple(b["actions"].shape) == (4, 16, 10)
    assert b["action_mask"].dtype == torch.bool and tuple(b["action_mask"].shape) == (4, 16)
    assert isinstance(b["task"], list) and all(isinstance(t, str) for t in b["task"])
    i = int(b["index"][0])
    raw, mask = ds.get_action_chunk(i, 16)
    np.testing.assert_allclose(b["actions"][0].numpy(), pipe.forward(raw), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pipe.inverse(b["actions"][0].numpy())[..., [0, 1, 2, 6]], raw[..., [0, 1, 2, 6]],
                               atol=1e-5)
    s = TrainingSamples(ds, horizon=4, cameras=["image"], image_size=None, state_key=None)[3]
    assert "state" not in s and tuple(s["images"]["image"].shape) == (64, 64, 3)


def test_dataloader_workers():
    ds = LeRobotDataset(FIXTURE)
    ds[0]  # the parent holds open decoders when the workers fork: they must not hang or share them
    samples = TrainingSamples(ds, horizon=8, cameras=["image"], image_size=64)
    loader = torch.utils.data.DataLoader(samples, batch_size=8, collate_fn=collate, num_workers=2,
                                         sampler=ResumableShardedSampler(len(samples), shuffle=False, drop_last=False))
    seen = torch.cat([b["index"] for b in loader]).tolist()
    assert seen == list(range(len(ds)))


def test_sampler_shards_are_disjoint_and_complete():
    n = 103
    for drop_last in (True, False):
        shards = [list(ResumableShardedSampler(n, num_replicas=4, rank=r, seed=7, drop_last=drop_last))
                  for r in range(4)]
        assert len({len(s) for s in shards}) == 1
        flat = [i for s in shards for i in s]
        if drop_last:
            assert len(flat) == len(set(flat)) == 100
        else:
            assert set(flat) == set(range(n)) and len(flat) == 104
    a = list(ResumableShardedSampler(n, seed=1))
    s = ResumableShardedSampler(n, seed=1)
    s.set_epoch(1)
    assert list(s) != a and sorted(list(ResumableShardedSampler(n, seed=1))) == sorted(a)


def test_sampler_resumes_exactly():
    s = ResumableShardedSampler(50, num_replicas=2, rank=1, seed=3)
    s.set_epoch(2)
    full = list(s.indices())
    it = iter(s)
    first = [next(it) for _ in range(9)]
    state = s.state_dict()
    assert state["position"] == 9 and state["epoch"] == 2
    s2 = ResumableShardedSampler(50, num_replicas=2, rank=1, seed=3)
    s2.load_state_dict(state)
    assert len(s2) == 25 - 9
    rest = list(s2)
    assert first + rest == full
    # after finishing an epoch the sampler moves on to the next one
    assert s2.epoch == 3 and s2.position == 0
    # explicit consumed position (DataLoader prefetching runs ahead)
    s3 = ResumableShardedSampler(50, num_replicas=2, rank=1, seed=3)
    s3.load_state_dict(s.state_dict(position=4))
    assert list(s3) == full[4:]


def test_data_cli(capsys):
    from wamkit.cli.data_cmd import main

    assert main(["inspect", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "episodes 3" in out and "frames 120" in out and "put the bowl on the plate" in out
    assert main(["stats", str(FIXTURE), "horizon=16", "representation=rot6d10"]) == 0
    out = capsys.readouterr().out
    assert "observation.state" in out and "rot6d10" in out
    from wamkit.core.errors import UserError

    with pytest.raises(UserError):
        main(["stats", str(FIXTURE), "representation=quat"])
    with pytest.raises(UserError):
        main(["nope"])
