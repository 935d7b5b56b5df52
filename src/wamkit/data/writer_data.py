"""The data side of the LeRobot writer: each episode's rows (the non-video features and the default columns) go to
the current data parquet until it would pass `files_size_in_mb`; then a new file, a new chunk every `chunks_size`
files. Each file carries the Hugging Face `datasets` feature metadata lerobot writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from wamkit.data.layout import DATA_PATH, format_path, next_file


class DataFileWriter:
    """Appends episodes' columns to data/chunk-XXX/file-YYY.parquet (the whole current file is rewritten per
    episode: parquet files cannot be appended to)."""

    def __init__(self, root: Path, features: dict[str, dict], keys: list[str], chunks_size: int,
                 files_size_in_mb: float):
        self.root, self.features, self.keys = root, features, keys
        self.chunks_size, self.files_size_in_mb = chunks_size, files_size_in_mb
        self._loc = (0, 0)
        self._tables: list = []  # episodes already in the current data file

    def table(self, cols: dict[str, np.ndarray]):
        """One episode's columns as an arrow table (fixed-size lists for vector features)."""
        import pyarrow as pa

        arrays, fields = [], []
        for key in self.keys:
            spec = self.features[key]
            v = cols[key]
            pa_type = pa.from_numpy_dtype(np.dtype(spec["dtype"]))
            if tuple(spec["shape"]) == (1,):
                arr = pa.array(v.reshape(-1), type=pa_type)
            else:
                width = int(np.prod(spec["shape"]))
                arr = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1), type=pa_type), width)
            arrays.append(arr)
            fields.append(pa.field(key, arr.type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=self.hf_metadata()))

    def hf_metadata(self) -> dict[bytes, bytes]:
        feats = {}
        for key in self.keys:
            spec = self.features[key]
            value = {"dtype": spec["dtype"], "_type": "Value"}
            if tuple(spec["shape"]) == (1,):
                feats[key] = value
            else:
                feats[key] = {"feature": value, "length": int(np.prod(spec["shape"])), "_type": "List"}
        return {b"huggingface": json.dumps({"info": {"features": feats}}).encode()}

    def write_episode(self, cols: dict[str, np.ndarray]) -> tuple[int, int]:
        """Write one episode's rows; returns the (chunk_index, file_index) of the file that holds them."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = self.table(cols)
        path = self.root / format_path(DATA_PATH, *self._loc)
        if self._tables and path.exists():
            cur_mb = path.stat().st_size / 2 ** 20
            if cur_mb + table.nbytes / 2 ** 20 >= self.files_size_in_mb:
                self._loc = next_file(self._loc, self.chunks_size)
                self._tables = []
                path = self.root / format_path(DATA_PATH, *self._loc)
        self._tables.append(table)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(self._tables), path)
        return self._loc
