"""The rows of a LeRobot dataset: its data parquet files loaded into numpy columns (video features excluded), checked
against info.json's feature shapes, ordered by `index`, with each row's episode bounds for action chunks."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wamkit.data.errors import DatasetError, FeatureMissingError
from wamkit.core.config import is_number
from wamkit.data.metadata import NUMERIC_DTYPES, read_parquet


def column_to_numpy(col, shape: Sequence[int] | None = None) -> np.ndarray | list:
    """A pyarrow column -> numpy (fixed/variable lists become (N, ...) arrays); strings -> list[str]."""
    import pyarrow as pa

    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return arr.to_pylist()
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        n = len(arr)
        flat = arr
        while pa.types.is_fixed_size_list(flat.type) or pa.types.is_list(flat.type) or \
                pa.types.is_large_list(flat.type):
            flat = flat.flatten()
        vals = flat.to_numpy(zero_copy_only=False)
        if shape is not None and int(np.prod(shape)) * n == vals.size:
            return vals.reshape(n, *shape)
        return vals.reshape(n, -1)
    return arr.to_numpy(zero_copy_only=False)


def is_numeric(col) -> bool:
    return isinstance(col, np.ndarray) and col.dtype.kind in "biuf"


def _rounding(ts: np.ndarray):
    """How far a stored time may be from the exact one: the spacing of its float type there (float32 timestamps
    past 2048 s are 2.4e-4 s apart: lerobot's tolerance alone would refuse a long episode that is right)."""
    return np.spacing(np.abs(ts)) if ts.dtype.kind == "f" else np.zeros(ts.shape)


def _held(col) -> str:
    """What a non-numeric column holds, for an error message: `strings (first: 'abc')`."""
    flat = col.reshape(-1) if isinstance(col, np.ndarray) else col
    first = flat[0] if len(flat) else None
    kind = "strings" if isinstance(first, str) else "nulls" if first is None else type(first).__name__
    return f"{kind} (first: {first!r})"[:120]


class DataColumns:
    """Every non-video column of the data files, as numpy (strings: lists), in `index` order."""

    def __init__(self, root: Path, info: dict, files: list[Path]):
        import pyarrow as pa

        self.root = root
        self.files = list(files)
        features: dict[str, dict] = info["features"]
        tables = [read_parquet(p, "data file") for p in files]
        # where each row came from (file, row in that file): errors about a row name the file a user can open
        self.row_file = np.concatenate([np.full(t.num_rows, k, np.int32) for k, t in enumerate(tables)] or
                                       [np.zeros(0, np.int32)])
        self.row_in_file = np.concatenate([np.arange(t.num_rows) for t in tables] or [np.zeros(0, np.int64)])
        try:
            table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
        except pa.ArrowInvalid as e:
            raise DatasetError(f"{root}: data files have incompatible schemas: {e}") from None
        self.columns: dict[str, Any] = {}
        info_path = root / "meta" / "info.json"
        for name in table.column_names:
            feat = features.get(name, {})
            if feat.get("dtype") in ("video",):
                continue
            shape = feat.get("shape")
            try:
                col = column_to_numpy(table.column(name), shape if shape and shape != [1] else None)
            except ValueError:   # rows of different lengths
                raise DatasetError(f"{info_path}: field 'features.{name}.shape' declares {shape} but the rows of "
                                   f"column {name!r} in the data files differ in length") from None
            if feat.get("dtype") in NUMERIC_DTYPES and not is_numeric(col):   # stats/training crashed on it
                raise DatasetError(f"{info_path}: field 'features.{name}.dtype' declares {feat['dtype']} but column "
                                   f"{name!r} in the data files holds {_held(col)}")
            if shape and isinstance(col, np.ndarray) and feat.get("dtype") != "image":
                got = [int(d) for d in col.shape[1:]] or [1]
                if got != list(shape) and not (list(shape) == [1] and got == [1]):
                    raise DatasetError(f"{info_path}: field 'features.{name}.shape' declares {shape} but the data "
                                       f"files hold {got} per row")
            self.columns[name] = col
        absent = [k for k, f in features.items() if f["dtype"] != "video" and k not in self.columns]
        if absent:
            raise DatasetError(f"{info_path}: field 'features.{absent[0]}' is declared but the data files have no "
                               f"such column")
        for need in ("episode_index", "frame_index", "timestamp", "index"):
            if need not in self.columns:
                raise DatasetError(f"{root}: data files lack the {need!r} column")
            if not is_numeric(self.columns[need]):
                raise DatasetError(f"{root}: column {need!r} of the data files holds {_held(self.columns[need])}, "
                                   f"not numbers")
        order = np.argsort(self.columns["index"], kind="stable")
        if not np.all(order == np.arange(len(order))):
            self.columns = {k: (v[order] if isinstance(v, np.ndarray) else [v[i] for i in order])
                            for k, v in self.columns.items()}
            self.row_file, self.row_in_file = self.row_file[order], self.row_in_file[order]
        ep = np.asarray(self.columns["episode_index"])
        n = len(ep)
        # the runs of rows of one episode_index, [run_starts[k], run_stops[k]); a valid dataset has one per episode
        change = np.flatnonzero(np.diff(ep) != 0) + 1
        self.run_starts = np.concatenate([[0], change]).astype(np.int64) if n else np.zeros(0, np.int64)
        self.run_stops = np.append(change, n).astype(np.int64) if n else np.zeros(0, np.int64)
        # last row of each row's episode (for action chunks)
        self.ep_last_row = np.repeat(self.run_stops - 1, self.run_stops - self.run_starts)
        self.num_rows = n
        expected = info.get("total_frames")
        if expected is not None and int(expected) != n:
            raise DatasetError(f"{root}: info.json says total_frames={expected} but the data files hold {n} rows")

    def __len__(self) -> int:
        return self.num_rows

    def where(self, i: int) -> str:
        """Row i as a user finds it: `row R (index I, episode E) of FILE`."""
        i = int(i)
        return (f"row {int(self.row_in_file[i])} (index {int(self.columns['index'][i])}, episode "
                f"{int(self.columns['episode_index'][i])}) of {self.files[int(self.row_file[i])]}")

    def check_finite(self, names: Sequence[str]) -> None:
        """DatasetError naming the file, row and episode of the first NaN/inf in the float columns `names`. One NaN
        action makes the action stats' quantiles NaN and with them every normalized chunk: the model trains to NaN
        without an error, so a training run checks its inputs before the first step."""
        for name in names:
            col = self.column(name)
            if not isinstance(col, np.ndarray) or col.dtype.kind not in "fc" or not len(col):
                continue
            bad = ~np.isfinite(col.reshape(len(col), -1)).all(axis=1)
            if bad.any():
                rows = np.flatnonzero(bad)
                raise DatasetError(f"column {name!r} has non-finite values (NaN/inf) in {rows.size} row(s), the "
                                   f"first: {self.where(rows[0])}")

    def check_episodes(self, episodes: dict[int, dict]) -> None:
        """The data rows against meta/episodes (episode_index -> its row there), DatasetError naming the file and
        the episode at the first mismatch:
        - a row whose episode_index is not in meta/episodes (it has no video location or task: reading it failed
          mid-run with a bare KeyError in a DataLoader worker);
        - an episode whose rows are not one contiguous run (its frames would be decoded at another episode's
          timestamps, its action chunks cut at the run's ends);
        - an episode of meta/episodes with no rows, or with another number of rows than its `length`, or whose rows
          are not those of its `dataset_from_index`..`dataset_to_index` (LeRobot's reader selects rows by those:
          the two readers would train on different rows). An episode was silently dropped before."""
        ep = np.asarray(self.columns["episode_index"])
        unknown = ~np.isin(ep, np.fromiter((int(k) for k in episodes), np.int64))
        if unknown.any():
            i = int(np.flatnonzero(unknown)[0])
            n = np.unique(ep[unknown]).size
            raise DatasetError(f"{self.files[int(self.row_file[i])]}: episode_index {int(ep[i])} (row "
                               f"{int(self.row_in_file[i])}) is not in meta/episodes"
                               + (f" (nor are {n - 1} other episode(s) of the data)" if n > 1 else ""))
        runs = self.episode_runs
        index = np.asarray(self.columns["index"])
        meta = f"{self.root}/meta/episodes"
        for e, row in episodes.items():
            if e not in runs:
                raise DatasetError(f"{meta}: episode {e} (length {row.get('length')}) has no rows in the data files")
        for e, row in episodes.items():
            a, b = runs[e]
            length = row.get("length")
            if length is not None and int(length) != b - a:
                raise DatasetError(f"{meta}: episode {e} has length {int(length)} but the data files hold {b - a} "
                                   f"rows of it (from {self.where(a)})")
            lo, hi = row.get("dataset_from_index"), row.get("dataset_to_index")
            if lo is not None and hi is not None and (int(lo), int(hi)) != (int(index[a]), int(index[b - 1]) + 1):
                raise DatasetError(f"{meta}: episode {e} has dataset_from_index..dataset_to_index {int(lo)}..{int(hi)}"
                                   f" but its rows have index {int(index[a])}..{int(index[b - 1]) + 1}")

    @cached_property
    def episode_runs(self) -> dict[int, tuple[int, int]]:
        """episode_index -> its [start, stop) rows (the runs computed at load); DatasetError naming the file and row
        when an episode's rows are not one contiguous run (its frames would be decoded at another episode's
        timestamps, its action chunks cut at the run's ends)."""
        ep = self.columns["episode_index"]
        runs: dict[int, tuple[int, int]] = {}
        for a, b in zip(self.run_starts.tolist(), self.run_stops.tolist()):
            e = int(ep[a])
            if e in runs:
                raise DatasetError(f"{self.files[int(self.row_file[a])]}: the rows of episode {e} are not one "
                                   f"contiguous run (they resume at {self.where(a)} after another episode's)")
            runs[e] = (a, b)
        return runs

    def _first_bad(self, bad: np.ndarray, what) -> DatasetError:
        """The error for the rows flagged in `bad`: `FILE: row R (index I, episode E): <what(first row)>`."""
        rows = np.flatnonzero(bad)
        i = int(rows[0])
        more = f" ({rows.size - 1} more row(s) too)" if rows.size > 1 else ""
        return DatasetError(f"{self.files[int(self.row_file[i])]}: row {int(self.row_in_file[i])} (index "
                            f"{int(self.columns['index'][i])}, episode {int(self.columns['episode_index'][i])}): "
                            f"{what(i)}{more}")

    def check_tasks(self, tasks: dict[int, str]) -> None:
        """Every row's task_index is in meta/tasks.parquet: an unknown one gave the row the task "" (trained on an
        empty instruction, silently), a null one a traceback mid-run."""
        if "task_index" not in self.columns:
            return
        ti = np.asarray(self.columns["task_index"]).reshape(self.num_rows, -1)[:, 0]
        null = ~np.isfinite(ti) if ti.dtype.kind == "f" else np.zeros(len(ti), bool)
        bad = null | ~np.isin(ti, np.fromiter(tasks, np.int64, len(tasks)))
        if bad.any():
            raise self._first_bad(bad, lambda i: ("task_index is null" if null[i] else f"task_index {ti[i]:g}")
                                  + f" is not in {self.root}/meta/tasks.parquet")

    def check_timestamps(self, fps: float, tolerance_s: float) -> None:
        """Each row's `timestamp` (where its frame is in the episode's video) is finite, >= 0, increasing within the
        episode and equal to frame_index / fps within tolerance_s (lerobot's check_timestamps_sync checks the
        steps): a NaN, zeroed or swapped timestamp decoded another row's frame without an error. A float column
        gets the spacing of its values on top of the tolerance (see _rounding)."""
        n = self.num_rows
        ts = np.asarray(self.columns["timestamp"]).reshape(n, -1)[:, 0]
        t = ts.astype(np.float64)
        bad = ~np.isfinite(t) | (t < 0)
        if bad.any():
            raise self._first_bad(bad, lambda i: f"timestamp {t[i]} is not a finite time >= 0")
        ep = np.asarray(self.columns["episode_index"])
        back = np.concatenate([[False], (ep[1:] == ep[:-1]) & (np.diff(t) <= 0)])
        if back.any():
            raise self._first_bad(back, lambda i: f"timestamp {t[i]:.6g} does not increase within the episode (the "
                                                  f"row before has {t[i - 1]:.6g})")
        fi = np.asarray(self.columns["frame_index"]).reshape(n, -1)[:, 0].astype(np.float64)
        tol = tolerance_s + _rounding(ts)
        off = ~(np.abs(t - fi / fps) <= tol)    # a NaN frame_index is off too
        if off.any():
            raise self._first_bad(off, lambda i: f"timestamp {t[i]:.6f} is not frame_index {fi[i]:g} / fps {fps:g} "
                                                 f"= {fi[i] / fps:.6f} (tolerance {tolerance_s:g} s)")

    def check_video_ends(self, episodes: dict[int, dict], video_keys: Sequence[str], fps: float,
                         tolerance_s: float) -> None:
        """Each episode's frames lie in its span of the video, [from_timestamp, to_timestamp) of meta/episodes: its
        last frame (from_timestamp + its last row's timestamp) comes before to_timestamp, and the spans of the
        episodes sharing a file do not overlap. A from_timestamp shifted by one frame read the next (or previous)
        episode's frame as this one's, silently. lerobot writes to_timestamp = from_timestamp + length / fps, so
        the last frame starts a whole frame before it; half a frame is the slack here. Runs after check_episodes
        and DatasetFiles.check_videos (from_timestamp checked)."""
        ts = np.asarray(self.columns["timestamp"]).reshape(self.num_rows, -1)[:, 0]
        slack = 0.5 / fps - tolerance_s
        for key in video_keys:
            spans: dict[tuple, list[tuple[float, float, int]]] = {}
            for e, row in episodes.items():
                t0, t1 = row.get(f"videos/{key}/from_timestamp"), row.get(f"videos/{key}/to_timestamp")
                if not is_number(t0) or not is_number(t1):
                    continue
                last = int(self.episode_runs[e][1]) - 1
                end = float(t0) + float(ts[last])
                if end > float(t1) - slack:
                    raise DatasetError(
                        f"{self.root}/meta/episodes: episode {e}: its last frame, at videos/{key}/from_timestamp "
                        f"{t0:g} + timestamp {float(ts[last]):g} ({self.where(last)}) = {end:g} s, is not before its "
                        f"to_timestamp {t1:g}")
                loc = (row.get(f"videos/{key}/chunk_index"), row.get(f"videos/{key}/file_index"))
                spans.setdefault(loc, []).append((float(t0), float(t1), e))
            for same_file in spans.values():
                same_file.sort()
                for (_, a1, ea), (b0, _, eb) in zip(same_file, same_file[1:]):
                    if b0 < a1 - slack:
                        raise DatasetError(f"{self.root}/meta/episodes: episode {eb}'s videos/{key}/from_timestamp "
                                           f"{b0:g} is inside episode {ea}'s span of the same file (to_timestamp "
                                           f"{a1:g})")

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def column(self, name: str) -> np.ndarray:
        if name not in self.columns:
            raise FeatureMissingError(f"{self.root}: column {name!r} not in dataset; available: "
                                      f"{', '.join(self.columns)}")
        return self.columns[name]

    def action_chunk(self, i: int, horizon: int, key: str = "action") -> tuple[np.ndarray, np.ndarray]:
        """Rows i .. i+horizon-1 of column `key` within i's episode: (horizon, D) and a bool mask (False = padding,
        which repeats the episode's last row)."""
        i = int(i)
        last = int(self.ep_last_row[i])
        want = np.arange(i, i + int(horizon))
        rows = np.minimum(want, last)
        return self.column(key)[rows], want <= last

    def episode_rows(self, episode_index: int) -> tuple[int, int]:
        """[start, end) rows of an episode."""
        run = self.episode_runs.get(int(episode_index))
        if run is None:
            raise DatasetError(f"{self.root}: no episode {episode_index}")
        return run
