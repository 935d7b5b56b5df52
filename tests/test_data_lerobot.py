"""LeRobot v3 reader/writer: the lerobot-written fixture decodes like lerobot; wamkit-written datasets round-trip and
match lerobot's layout; errors name the file/feature."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from wamkit.core.errors import UserError
from wamkit.data.errors import CorruptFileError, FeatureMissingError, FpsMismatchError, MissingFileError
from wamkit.data.lerobot import LeRobotDataset, read_tasks
from wamkit.data.writer import LeRobotWriter

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot_v3_libero_tiny"
EXPECTED = Path(__file__).parent / "fixtures" / "lerobot_v3_libero_tiny.expected.json"
CAMS = ["observation.images.image", "observation.images.wrist_image"]


def test_fixture_matches_lerobot_decoding():
    exp = json.loads(EXPECTED.read_text())
    ds = LeRobotDataset(FIXTURE)
    assert len(ds) == exp["num_frames"] and ds.num_episodes == exp["num_episodes"] and ds.fps == exp["fps"]
    worst = 0.0
    for fr in exp["frames"]:
        it = ds[fr["index"]]
        np.testing.assert_array_equal(it["action"], np.asarray(fr["action"], np.float32))
        np.testing.assert_array_equal(it["observation.state"], np.asarray(fr["observation.state"], np.float32))
        assert it["task"] == fr["task"]
        assert (int(it["episode_index"]), int(it["frame_index"]), int(it["index"])) == \
            (fr["episode_index"], fr["frame_index"], fr["index"])
        assert abs(float(it["timestamp"]) - fr["timestamp"]) < 1e-6
        for cam in CAMS:
            img = it[cam]
            assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
            worst = max(worst, np.abs(img.reshape(-1, 3).mean(0) - np.asarray(fr[cam + ".mean_u8"])).max())
    assert worst < 2.0


def test_fixture_random_access_matches_too():
    exp = json.loads(EXPECTED.read_text())
    ds = LeRobotDataset(FIXTURE, cameras=["wrist_image"])
    for i in np.random.default_rng(0).permutation(len(ds))[:40]:
        fr = exp["frames"][i]
        m = ds[int(i)]["observation.images.wrist_image"].reshape(-1, 3).mean(0)
        assert np.abs(m - np.asarray(fr["observation.images.wrist_image.mean_u8"])).max() < 2.0


def test_sequential_decoding_does_not_reopen(monkeypatch):
    import av

    opens = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: (opens.append(a[0]), real_open(*a, **k))[1])
    ds = LeRobotDataset(FIXTURE)
    for i in range(len(ds)):
        ds[i]
    assert len(opens) == 2  # one container per video file, kept open
    st = ds.video_stats()
    assert st["opens"] == 2 and st["seeks"] == 0 and st["decoded"] == 2 * len(ds)


def test_action_chunk_padding():
    ds = LeRobotDataset(FIXTURE, cameras=[])
    s, e = ds.episode_rows(0)
    acts, mask = ds.get_action_chunk(e - 3, 8)
    assert mask.tolist() == [True] * 3 + [False] * 5
    np.testing.assert_array_equal(acts[3:], np.repeat(ds.column("action")[e - 1][None], 5, 0))
    acts, mask = ds.get_action_chunk(s, 8)
    assert mask.all()
    np.testing.assert_array_equal(acts, ds.column("action")[s:s + 8])


def test_fps_mismatch_is_an_error_unless_allowed():
    with pytest.raises(FpsMismatchError, match="fps is 10 but the config expects 20"):
        LeRobotDataset(FIXTURE, check_fps=20)
    assert LeRobotDataset(FIXTURE, check_fps=20, allow_fps_mismatch=True).fps == 10
    LeRobotDataset(FIXTURE, check_fps=10)


def test_missing_feature_and_camera_are_named():
    with pytest.raises(FeatureMissingError, match="observation.velocity"):
        LeRobotDataset(FIXTURE, required_features=["action", "observation.velocity"])
    with pytest.raises(FeatureMissingError, match="'top'.*image, wrist_image"):
        LeRobotDataset(FIXTURE, cameras=["top"])


def _copy(tmp_path):
    dst = tmp_path / "ds"
    shutil.copytree(FIXTURE, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def test_missing_files_are_named(tmp_path):
    root = _copy(tmp_path)
    video = root / "videos/observation.images.wrist_image/chunk-000/file-000.mp4"
    video.unlink()
    with pytest.raises(MissingFileError, match=str(video)):
        LeRobotDataset(root)
    LeRobotDataset(root, cameras=["image"])  # only the cameras asked for must exist
    data = root / "data/chunk-000/file-000.parquet"
    data.unlink()
    with pytest.raises(MissingFileError, match=str(data)) as e:
        LeRobotDataset(root, cameras=["image"])
    assert isinstance(e.value, UserError)
    (root / "meta/info.json").unlink()
    with pytest.raises(MissingFileError, match="info.json"):
        LeRobotDataset(root)


def test_corrupt_files_are_named(tmp_path):
    root = _copy(tmp_path)
    data = root / "data/chunk-000/file-000.parquet"
    data.write_bytes(data.read_bytes()[:200])
    with pytest.raises(CorruptFileError, match=str(data)):
        LeRobotDataset(root)
    root2 = _copy(tmp_path / "b")
    video = root2 / "videos/observation.images.image/chunk-000/file-000.mp4"
    video.write_bytes(b"\x00" * 64 + video.read_bytes()[5000:])
    ds = LeRobotDataset(root2, cameras=["image"])
    with pytest.raises(CorruptFileError, match=str(video)):
        ds[0]
    (root2 / "meta/info.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="info.json"):
        LeRobotDataset(root2)


def _write(root, n_episodes=4, codec="av1", size=32, **kw):
    feats = {
        "observation.images.image": {"dtype": "video", "shape": [size, size, 3], "names": ["height", "width", "channels"]},
        "observation.images.wrist_image": {"dtype": "video", "shape": [size, size, 3]},
        "observation.state": {"dtype": "float32", "shape": [8], "names": [f"s{i}" for i in range(8)]},
        "action": {"dtype": "float32", "shape": [7], "names": None},
    }
    rng = np.random.default_rng(0)
    truth = []
    w = LeRobotWriter(root, fps=10, features=feats, robot_type="panda", video_codec=codec, **kw)
    for e in range(n_episodes):
        for i in range(12 + 3 * e):
            img = np.zeros((size, size, 3), np.uint8)
            img[..., 0] = (20 * i) % 256
            img[..., 1] = 60 * e
            img[..., 2] = 128
            frame = {"observation.images.image": img, "observation.images.wrist_image": 255 - img,
                     "observation.state": rng.normal(size=8).astype(np.float32),
                     "action": rng.normal(size=7).astype(np.float32)}
            w.add_frame(frame)
            truth.append((frame, f"task {e % 3}"))
        w.save_episode(f"task {e % 3}")
    w.finalize()
    return truth


def test_written_dataset_round_trips_with_many_files(tmp_path):
    root = tmp_path / "w"
    truth = _write(root, n_episodes=5, data_files_size_in_mb=0.003, video_files_size_in_mb=0.003)
    ds = LeRobotDataset(root)
    assert len(ds) == len(truth) and ds.num_episodes == 5 and ds.fps == 10
    assert len(list((root / "data").rglob("*.parquet"))) > 1
    for cam in CAMS:
        files = list((root / "videos" / cam).rglob("*.mp4"))
        assert len(files) > 1
    # several episodes share at least one mp4 when the limit allows it
    root2 = tmp_path / "w2"
    _write(root2, n_episodes=3)
    ds2 = LeRobotDataset(root2)
    assert [e["videos/observation.images.image/file_index"] for e in ds2.episodes] == [0, 0, 0]
    assert [e["videos/observation.images.image/from_timestamp"] for e in ds2.episodes] == [0.0, 1.2, 2.7]
    for d, n in ((ds, len(truth)), (ds2, len(ds2))):
        for i in range(n):
            it = d[i]
            frame, task = truth[i]
            np.testing.assert_array_equal(it["action"], frame["action"])
            np.testing.assert_array_equal(it["observation.state"], frame["observation.state"])
            assert it["task"] == task
            for cam in CAMS:
                diff = np.abs(it[cam].astype(float).mean((0, 1)) - frame[cam].astype(float).mean((0, 1))).max()
                assert diff < 4.0, (i, cam, diff)  # lossy yuv420p (limited range)


def test_h264_round_trip(tmp_path):
    truth = _write(tmp_path / "h", n_episodes=2, codec="h264")
    ds = LeRobotDataset(tmp_path / "h")
    assert ds.features["observation.images.image"]["info"]["video.codec"] == "h264"
    for i in range(len(ds)):
        diff = np.abs(ds[i]["observation.images.image"].astype(float).mean((0, 1)) -
                      truth[i][0]["observation.images.image"].mean((0, 1))).max()
        assert diff < 4.0


def test_written_metadata_matches_lerobot_layout(tmp_path):
    root = tmp_path / "w"
    _write(root, n_episodes=3)
    fx_info = json.loads((FIXTURE / "meta/info.json").read_text())
    info = json.loads((root / "meta/info.json").read_text())
    assert list(info) == list(fx_info)
    assert info["data_path"] == fx_info["data_path"] and info["video_path"] == fx_info["video_path"]
    for cam in CAMS:
        assert set(info["features"][cam]) == set(fx_info["features"][cam])
        assert set(info["features"][cam]["info"]) == set(fx_info["features"][cam]["info"])
    assert list(info["features"]) == list(fx_info["features"])
    fx_ep = pq.read_table(FIXTURE / "meta/episodes/chunk-000/file-000.parquet")
    ep = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet")
    assert ep.column_names == fx_ep.column_names
    for name in fx_ep.column_names:
        assert ep.schema.field(name).type == fx_ep.schema.field(name).type, name
    fx_data = pq.read_table(FIXTURE / "data/chunk-000/file-000.parquet")
    data = pq.read_table(root / "data/chunk-000/file-000.parquet")
    assert data.schema.remove_metadata() == fx_data.schema.remove_metadata()
    fx_tasks = pq.read_table(FIXTURE / "meta/tasks.parquet")
    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert tasks.column_names == fx_tasks.column_names
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]
    assert read_tasks(root / "meta/tasks.parquet") == {0: "task 0", 1: "task 1", 2: "task 2"}
    fx_stats = json.loads((FIXTURE / "meta/stats.json").read_text())
    stats = json.loads((root / "meta/stats.json").read_text())
    assert set(stats) == set(fx_stats)
    for k in fx_stats:
        assert list(stats[k]) == list(fx_stats[k])
        assert np.asarray(stats[k]["mean"]).shape == np.asarray(fx_stats[k]["mean"]).shape
    assert stats["index"]["min"] == [0.0] and stats["index"]["count"] == [12 + 15 + 18]
    acts = LeRobotDataset(root, cameras=[]).column("action")
    np.testing.assert_allclose(stats["action"]["mean"], acts.mean(0), atol=1e-6)
    np.testing.assert_allclose(stats["action"]["std"], acts.std(0), atol=1e-6)


def test_old_style_placeholders_and_tasks_index(tmp_path):
    import pyarrow as pa

    root = _copy(tmp_path)
    info = json.loads((root / "meta/info.json").read_text())
    info["data_path"] = "data/chunk-{episode_chunk:03d}/file-{episode_file:03d}.parquet"
    info["video_path"] = "videos/{video_key}/chunk-{episode_chunk:03d}/file-{episode_file:03d}.mp4"
    (root / "meta/info.json").write_text(json.dumps(info))
    t = pq.read_table(root / "meta/tasks.parquet")
    pq.write_table(pa.table({"task_index": t.column("task_index"), "__index_level_0__": t.column("task")}),
                   root / "meta/tasks.parquet")
    ds = LeRobotDataset(root)
    assert ds[40]["task"] == LeRobotDataset(FIXTURE, cameras=[])[40]["task"]
    assert ds[40]["observation.images.image"].shape == (64, 64, 3)


def test_writer_rejects_bad_frames(tmp_path):
    w = LeRobotWriter(tmp_path / "x", fps=10, features={"action": {"dtype": "float32", "shape": [7]}})
    with pytest.raises(FeatureMissingError, match="action"):
        w.add_frame({"state": np.zeros(3)})
    with pytest.raises(UserError, match="shape"):
        w.add_frame({"action": np.zeros(6)})


def test_writer_output_is_byte_identical_for_the_same_frames(tmp_path):
    """Same frames, same options -> the same bytes in every file (the data/video/meta parts of the writer keep no
    hidden state such as times or random names; bench/data_golden.py compares two commits this way)."""
    import hashlib

    def digest(root):
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    for name in ("a", "b"):
        _write(tmp_path / name, n_episodes=3, data_files_size_in_mb=0.003, video_files_size_in_mb=0.003,
               chunks_size=2)
    a, b = digest(tmp_path / "a"), digest(tmp_path / "b")
    assert len([k for k in a if k.startswith("data/chunk-001/")]) >= 1   # rolled over into a second chunk
    assert a == b
