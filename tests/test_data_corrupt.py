"""Corrupted copies of the LeRobot fixture: every case is one line naming the file and the field, exit code 2 from
the CLI (`wamkit data inspect`), never a traceback, never a silent wrong read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wamkit.cli.main import main
from wamkit.data.errors import DatasetError
from wamkit.data.lerobot import LeRobotDataset

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot_v3_libero_tiny"
VIDEO = Path("videos/observation.images.image/chunk-000/file-000.mp4")


def _copy(tmp_path) -> Path:
    root = tmp_path / "ds"
    shutil.copytree(FIXTURE, root)
    return root


def _edit_info(root: Path, fn) -> Path:
    p = root / "meta" / "info.json"
    info = json.loads(p.read_text())
    fn(info)
    p.write_text(json.dumps(info))
    return p


def _inspect_fails(capsys, root: Path, *must_name: str) -> str:
    capsys.readouterr()
    assert main(["data", "inspect", str(root)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for s in must_name:
        assert s in err, (s, err)
    return err


def test_the_fixture_itself_inspects_fine(capsys):
    assert main(["data", "inspect", str(FIXTURE)]) == 0
    assert "video files 2" in capsys.readouterr().out


@pytest.mark.parametrize("edit,field", [
    (lambda i: i.update(fps="ten"), "'fps'"),
    (lambda i: i.update(fps=0), "'fps'"),
    (lambda i: i.update(fps=-10), "'fps'"),
    (lambda i: i.pop("fps"), "'fps'"),
    (lambda i: i.pop("features"), "'features'"),
    (lambda i: i.update(features=[1, 2]), "'features'"),
    (lambda i: i["features"]["action"].update(shape="seven"), "'features.action.shape'"),
    (lambda i: i["features"]["action"].pop("dtype"), "'features.action'"),
    (lambda i: i.update(data_path=None), "'data_path'"),
    (lambda i: i.update(total_frames="many"), "'total_frames'"),
    (lambda i: i.update(video_path="videos/{video_key.__class__}/{chunk_index}/{file_index}.mp4"), "'video_path'"),
    (lambda i: i.update(video_path="/etc/{video_key}-{chunk_index}-{file_index}.mp4"), "'video_path'"),
    (lambda i: i.update(video_path="videos/{video_key}/chunk-{chunk_index:03d"), "'video_path'"),
], ids=["fps-str", "fps-0", "fps-neg", "fps-missing", "features-missing", "features-list", "shape-str",
        "dtype-missing", "data_path-null", "total_frames-str", "template-attr", "template-abs", "template-bad"])
def test_bad_info_fields_name_the_file_and_field(tmp_path, capsys, edit, field):
    root = _copy(tmp_path)
    info = _edit_info(root, edit)
    _inspect_fails(capsys, root, str(info), field)


def test_info_that_is_not_an_object(tmp_path, capsys):
    root = _copy(tmp_path)
    (root / "meta" / "info.json").write_text("[1, 2, 3]")
    _inspect_fails(capsys, root, "info.json")


@pytest.mark.parametrize("declared", [[6], [8], [7, 2]])
def test_declared_action_shape_that_disagrees_with_the_data_is_an_error(tmp_path, capsys, declared):
    root = _copy(tmp_path)
    info = _edit_info(root, lambda i: i["features"]["action"].update(shape=declared))
    err = _inspect_fails(capsys, root, str(info), "'features.action.shape'", str(declared))
    assert "[7]" in err    # what the data holds
    with pytest.raises(DatasetError):
        LeRobotDataset(root)   # the training path refuses it too


def test_declared_feature_missing_from_the_data(tmp_path, capsys):
    root = _copy(tmp_path)
    info = _edit_info(root, lambda i: i["features"].update(extra={"dtype": "float32", "shape": [2], "names": None}))
    _inspect_fails(capsys, root, str(info), "'features.extra'")


@pytest.mark.parametrize("content", [b"", b"this is not an mp4 file at all" * 100, None],
                         ids=["empty", "garbage", "truncated"])
def test_data_inspect_exits_2_on_a_broken_mp4(tmp_path, capsys, content):
    root = _copy(tmp_path)
    mp4 = root / VIDEO
    if content is None:      # the container header only: no decodable frame
        content = mp4.read_bytes()[:200]
    mp4.write_bytes(content)
    _inspect_fails(capsys, root, str(mp4))


def test_video_frames_of_another_size_than_declared(tmp_path, capsys):
    root = _copy(tmp_path)
    _edit_info(root, lambda i: i["features"]["observation.images.image"].update(shape=[32, 32, 3]))
    _inspect_fails(capsys, root, "file-000.mp4", "32x32")


@pytest.mark.parametrize("template", [
    "../../../{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
    "videos/../../outside/{video_key}-{chunk_index}-{file_index}.mp4",
])
def test_video_path_outside_the_dataset_is_refused(tmp_path, capsys, template):
    root = _copy(tmp_path)
    # a real video where the template points, so only the containment check can refuse it
    target = (root / template.format(video_key="observation.images.image", chunk_index=0, file_index=0))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / VIDEO, target)
    _edit_info(root, lambda i: i.update(video_path=template))
    _inspect_fails(capsys, root, "outside the dataset")


def test_data_path_outside_the_dataset_is_refused(tmp_path, capsys):
    root = _copy(tmp_path)
    shutil.copy(root / "data/chunk-000/file-000.parquet", tmp_path / "file-000.parquet")
    _edit_info(root, lambda i: i.update(data_path="../file-{file_index:03d}.parquet"))
    _inspect_fails(capsys, root, "outside the dataset")


def test_episode_without_a_video_start_time(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _copy(tmp_path)
    ep = root / "meta/episodes/chunk-000/file-000.parquet"
    t = pq.read_table(ep)
    col = "videos/observation.images.image/from_timestamp"
    t = t.set_column(t.column_names.index(col), col, pa.array([None] * t.num_rows, pa.float64()))
    pq.write_table(t, ep)
    _inspect_fails(capsys, root, "from_timestamp", "meta/episodes")


DATA = Path("data/chunk-000/file-000.parquet")


def set_cell(root: Path, column: str, row: int, dim: int, value: float) -> Path:
    """Write `value` into row `row`, element `dim` of a fixed-size-list column of the fixture copy's data file."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / DATA
    t = pq.read_table(path)
    typ = t.schema.field(column).type
    vals = np.stack(t.column(column).to_numpy(zero_copy_only=False)).astype(np.float32)
    vals[row, dim] = value
    arr = pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1), typ.value_type), typ.list_size)
    pq.write_table(t.set_column(t.column_names.index(column), column, arr), path)
    return path


@pytest.mark.parametrize("column,value", [("action", float("nan")), ("action", float("inf")),
                                          ("observation.state", float("-inf"))])
def test_non_finite_values_are_named_with_file_row_and_episode(tmp_path, capsys, column, value):
    """One NaN action made the action stats' quantiles NaN and trained a NaN model, exit 0: the training path
    checks its columns (LeRobotDataset.check_finite) and names where the bad value is."""
    root = _copy(tmp_path)
    path = set_cell(root, column, 40, 2, value)          # row 40: episode 1 (rows 33..90)
    ds = LeRobotDataset(root)
    ds.check_finite(["timestamp"])                       # other columns are fine
    with pytest.raises(DatasetError) as e:
        ds.check_finite(["action", "observation.state"])
    msg = str(e.value)
    for s in (repr(column), "1 row(s)", "row 40 (index 40, episode 1)", str(path)):
        assert s in msg, (s, msg)
    LeRobotDataset(FIXTURE).check_finite(["action", "observation.state"])
    _inspect_fails(capsys, root, repr(column), "row 40 (index 40, episode 1)")     # `wamkit data inspect` says so


def test_rows_of_an_episode_missing_from_the_episodes_metadata(tmp_path, capsys):
    """Rows whose episode_index meta/episodes does not list failed mid-run with a bare KeyError in a DataLoader
    worker: refused at load, naming the data file and the episode."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _copy(tmp_path)
    path = root / DATA
    t = pq.read_table(path)
    ep = t.column("episode_index").to_pylist()
    ep = [7 if e == 2 else e for e in ep]                 # episode 2's rows (91..119) relabelled 7
    pq.write_table(t.set_column(t.column_names.index("episode_index"), "episode_index", pa.array(ep, pa.int64())),
                   path)
    err = _inspect_fails(capsys, root, str(path), "episode_index 7", "row 91", "meta/episodes")
    assert "KeyError" not in err
    with pytest.raises(DatasetError, match="episode_index 7"):
        LeRobotDataset(root)


def _relabel(path: Path, change) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    ep = change(t.column("episode_index").to_pylist())
    pq.write_table(t.set_column(t.column_names.index("episode_index"), "episode_index", pa.array(ep, pa.int64())),
                   path)


def _set_episodes(root: Path, **columns) -> None:
    """Overwrite columns of meta/episodes (each value: {episode_index: new value})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = next((root / "meta" / "episodes").rglob("*.parquet"))
    t = pq.read_table(path)
    eps = t.column("episode_index").to_pylist()
    for name, new in columns.items():
        vals = [new.get(e, v) for e, v in zip(eps, t.column(name).to_pylist())]
        t = t.set_column(t.column_names.index(name), name, pa.array(vals, t.schema.field(name).type))
    pq.write_table(t, path)


def test_episode_rows_that_do_not_match_the_episodes_metadata_are_named(tmp_path, capsys):
    """A probe's findings, each read without a word before: an episode of meta/episodes with no rows (dropped), an
    episode whose rows resume after another's (its frames decoded at the other's timestamps), a `length` or a
    dataset_from_index..dataset_to_index that the rows do not match (LeRobot's reader selects rows by those)."""
    import shutil

    # episode 1's rows (33..90) relabelled 0: episode 1 has no rows left (and 0 is 91 rows long)
    root = _copy(tmp_path / "a")
    _relabel(root / DATA, lambda ep: [0 if e == 1 else e for e in ep])
    _inspect_fails(capsys, root, "episode 1", "has no rows")
    # rows 50..55 of episode 1 relabelled 0: episode 0 is no longer one run
    root = _copy(tmp_path / "b")
    _relabel(root / DATA, lambda ep: [0 if 50 <= i <= 55 else e for i, e in enumerate(ep)])
    _inspect_fails(capsys, root, "episode 0", "not one contiguous run", "row 50")
    # meta/episodes says episode 1 has 10 rows; then that episode 2 spans up to 10000
    root = _copy(tmp_path / "c")
    _set_episodes(root, length={1: 10})
    _inspect_fails(capsys, root, "episode 1 has length 10", "58 rows")
    shutil.rmtree(root)
    root = _copy(tmp_path / "c")
    _set_episodes(root, dataset_to_index={2: 10000})
    _inspect_fails(capsys, root, "episode 2", "91..10000", "91..120")
