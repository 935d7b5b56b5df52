"""Append-only results journal (OUT/results.jsonl): one JSON line per finished episode, flushed and fsynced.

Resume reads it back, keeps the first record per episode key (a torn last line from a killed process is ignored),
and the scheduler runs only the missing episodes: nothing is lost or counted twice."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Journal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._load()
        self._fh = None

    def _load(self) -> None:
        good: list[str] = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn write of a killed run
                if not isinstance(rec, dict) or "key" not in rec:
                    continue
                if rec["key"] not in self.records:
                    self.records[rec["key"]] = rec
                    good.append(json.dumps(rec, sort_keys=True))
        # rewrite without torn/duplicate lines so the file stays a clean JSONL
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(g + "\n" for g in good), encoding="utf-8")
        os.replace(tmp, self.path)

    def done(self, key: str) -> bool:
        return key in self.records

    def append(self, rec: dict[str, Any]) -> None:
        if rec["key"] in self.records:
            raise RuntimeError(f"episode {rec['key']} recorded twice")
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps(rec, sort_keys=True) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records[rec["key"]] = rec

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
