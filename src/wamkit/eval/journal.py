"""Append-only results journal (OUT/results.jsonl): one JSON line per finished episode, flushed and fsynced.

Resume reads it back, keeps the first record per episode key, and the scheduler runs only the missing episodes:
nothing is lost or counted twice. A line that is not a complete, well-formed record (a torn last line from a killed
process, bytes that are not UTF-8, JSON that is not an object, a missing or mistyped field, a key that disagrees with
its suite/task_id/trial) is never counted as done: it is moved to OUT/results.jsonl.rejected, its line number
reported in `bad_lines` (and logged), and its episode runs again. A later record of an episode already recorded
with other content (journals merged by hand, a second writer) is moved there too and reported in `conflicts`; the
first one stays the episode's record (see Journal._load for why)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from wamkit.core.files import write_atomic

# field -> accepted types of a finished episode's record (what resume, metrics and the report read)
REQUIRED = {"key": (str,), "suite": (str,), "task_id": (int,), "trial": (int,), "success": (bool,), "steps": (int,)}


def record_problem(rec: Any) -> str | None:
    """Why `rec` is not a usable episode record, or None."""
    if not isinstance(rec, dict):
        return f"not a JSON object ({type(rec).__name__})"
    for k, types in REQUIRED.items():
        if k not in rec:
            return f"missing field {k!r}"
        v = rec[k]
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            return f"field {k!r} has the wrong type ({type(v).__name__})"
    if rec["steps"] < 0:
        return "field 'steps' is negative"
    if rec["key"] != f"{rec['suite']}/{rec['task_id']}/{rec['trial']}":
        return f"key {rec['key']!r} does not match suite/task_id/trial"
    return None


def _first_of(items: list[str], most: int, sep: str) -> str:
    """The first `most` items joined by `sep`, and how many more there are."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return sep.join(items[:most]) + more


class Journal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self.bad_lines: list[tuple[int, str]] = []    # (1-based line number, why) of lines skipped on load
        self.conflicts: list[tuple[int, str]] = []    # (line number, what) of later records of a recorded episode
        self._tidy: tuple[list[str], list[bytes]] | None = None   # (good records, set-aside lines) until tidy()
        if self.path.exists():
            self._load()
        self._fh = None

    def _load(self) -> None:
        good: list[str] = []
        bad: list[bytes] = []
        first: dict[str, int] = {}    # key -> line number of its record
        with open(self.path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw.decode("utf-8"))
                    problem = record_problem(rec)
                except UnicodeDecodeError:
                    problem = "not UTF-8"
                except json.JSONDecodeError:
                    problem = "not complete JSON (torn write?)"
                except (ValueError, RecursionError) as e:
                    problem = f"unreadable JSON ({type(e).__name__})"
                if problem is not None:
                    self.bad_lines.append((n, problem))
                    bad.append(raw if raw.endswith(b"\n") else raw + b"\n")
                    continue
                key = rec["key"]
                if key not in self.records:
                    self.records[key] = rec
                    first[key] = n
                    good.append(json.dumps(rec, sort_keys=True))
                elif rec != self.records[key]:
                    # The same episode recorded again with other content. The first record is kept, deterministically:
                    # this journal is append-only and a run never records an episode twice, so the first is the one
                    # that every summary written from this file has counted; which of two disagreeing outcomes is
                    # right the file cannot say, so the later one is not silently dropped but set aside (rejected)
                    # and named, and the warning says whether the two disagree on the outcome.
                    old = self.records[key]
                    outcome = ("a different outcome" if (old["success"], old["steps"]) != (rec["success"], rec["steps"])
                               else "the same outcome, other details")
                    self.conflicts.append((n, f"episode {key} again (first at line {first[key]}), {outcome}"))
                    bad.append(raw if raw.endswith(b"\n") else raw + b"\n")
        if bad:
            self._tidy = (good, bad)

    def tidy(self) -> None:
        """Set the bad and conflicting lines found on load aside (OUT/results.jsonl.rejected) and rewrite the journal
        without them, so the file stays a clean JSONL. Loading alone changes no file: a resume refused after loading
        (its tasks resolve to other ids) leaves the journal as it found it. Called before the first append."""
        if self._tidy is None:
            return
        good, bad = self._tidy
        with open(self.rejected_path, "ab") as f:
            f.writelines(bad)
        write_atomic(self.path, "".join(g + "\n" for g in good))
        self._tidy = None

    @property
    def rejected_path(self) -> Path:
        return self.path.with_name(self.path.name + ".rejected")

    def bad_lines_message(self) -> str:
        """One line: which lines of the journal were skipped and why (their episodes run again)."""
        if not self.bad_lines:
            return ""
        shown = _first_of([f"{n} ({why})" for n, why in self.bad_lines], 10, ", ")
        return (f"{self.path}: skipped {len(self.bad_lines)} bad line(s): {shown}; their episodes run again "
                f"(the lines are kept in {self.rejected_path})")

    def conflicts_message(self) -> str:
        """One line: which lines recorded an episode a second time with other content (set aside, not counted)."""
        if not self.conflicts:
            return ""
        shown = _first_of([f"line {n}: {what}" for n, what in self.conflicts], 5, "; ")
        return (f"{self.path}: {len(self.conflicts)} line(s) record an episode already recorded, with other content: "
                f"{shown}; the first record of each episode is kept and counted, the later lines moved to "
                f"{self.rejected_path}")

    def warnings(self) -> list[str]:
        """The one-line warnings of loading the journal (bad lines, conflicting records), for the log."""
        return [m for m in (self.bad_lines_message(), self.conflicts_message()) if m]

    def done(self, key: str) -> bool:
        return key in self.records

    def append(self, rec: dict[str, Any]) -> None:
        if rec["key"] in self.records:
            raise RuntimeError(f"episode {rec['key']} recorded twice")
        if self._fh is None:
            self.tidy()
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
