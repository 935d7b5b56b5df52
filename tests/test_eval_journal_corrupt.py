"""Resume with a corrupt results journal: bad lines (non-UTF-8 bytes, a truncated line, a line missing fields) are
skipped and reported by line number, never counted as done, and their episodes run again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit.eval.journal import Journal

ROOT = Path(__file__).resolve().parents[1]


def rec(task_id, trial, success=True, steps=10):
    return {"key": f"s/{task_id}/{trial}", "suite": "s", "task_id": task_id, "trial": trial, "task": "t",
            "success": success, "steps": steps}


def _corrupt(lines: list[bytes]) -> list[bytes]:
    """Lines 2..5 of a 6-line journal made bad in four ways; 1 and 6 stay good."""
    out = list(lines)
    out[1] = out[1].replace(b'"key": "', b'"key": "\xff\xfe', 1)      # not UTF-8
    assert b'\xff' in out[1]
    d = json.loads(out[2])
    del d["success"]
    out[2] = json.dumps(d).encode() + b"\n"                         # a field missing (was counted as done)
    out[3] = b'["not", "a", "record"]\n'                            # JSON, but not a record
    out[4] = out[4][: len(out[4]) // 2] + b"\n"                     # truncated
    return out


def test_bad_lines_are_skipped_reported_and_not_done(tmp_path):
    p = tmp_path / "results.jsonl"
    j = Journal(p)
    for t in range(6):
        j.append(rec(t, 0))
    j.close()
    p.write_bytes(b"".join(_corrupt(p.read_bytes().splitlines(keepends=True))))

    j = Journal(p)
    assert set(j.records) == {"s/0/0", "s/5/0"}
    assert [n for n, _ in j.bad_lines] == [2, 3, 4, 5]
    msg = j.bad_lines_message()
    assert "\n" not in msg and str(p) in msg and "2 (not UTF-8)" in msg and "'success'" in msg
    # loading changes no file; tidy() (the runner's, once a resume is accepted; else the first append) cleans it,
    # the bad lines kept aside, and the re-run episodes can be appended
    assert len(p.read_bytes().splitlines()) == 6 and not j.rejected_path.exists()
    j.tidy()
    assert len(p.read_text(encoding="utf-8").splitlines()) == 2
    assert len(j.rejected_path.read_bytes().splitlines()) == 4
    for t in range(1, 5):
        j.append(rec(t, 0))
    j.close()
    assert set(Journal(p).records) == {f"s/{t}/0" for t in range(6)}


@pytest.mark.parametrize("bad", [
    {"key": "s/0/0", "suite": "s", "task_id": 0, "trial": 0, "success": "yes", "steps": 3},
    {"key": "s/0/0", "suite": "s", "task_id": 0, "trial": 0, "success": True, "steps": -1},
    {"key": "s/0/0", "suite": "s", "task_id": True, "trial": 0, "success": True, "steps": 3},
    {"key": "s/9/9", "suite": "s", "task_id": 0, "trial": 0, "success": True, "steps": 3},
])
def test_mistyped_or_inconsistent_records_are_not_done(tmp_path, bad):
    p = tmp_path / "results.jsonl"
    p.write_text(json.dumps(bad) + "\n")
    j = Journal(p)
    assert j.records == {} and [n for n, _ in j.bad_lines] == [1]


@pytest.mark.slow
@pytest.mark.metaworld
def test_resume_over_a_corrupt_journal_reruns_the_bad_episodes(tmp_path):
    pytest.importorskip("metaworld")
    out = tmp_path / "run"
    args = ["eval", "env=metaworld", "suite=mt", "env_args.tasks=reach-v3,drawer-open-v3", "trials=3",
            "image_size=32", "policy=metaworld-expert", "horizon=4", "max_steps=20", "progress=false", f"out={out}"]

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "wamkit.cli.main", *args, *extra], capture_output=True,
                              timeout=600, cwd=ROOT)

    assert cli().returncode == 0
    results = out / "results.jsonl"
    before = [json.loads(x) for x in results.read_bytes().splitlines()]
    assert len(before) == 6
    results.write_bytes(b"".join(_corrupt(results.read_bytes().splitlines(keepends=True))))

    r = cli("resume=true")
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    warn = [line for line in r.stderr.decode().splitlines() if "bad line" in line]
    assert len(warn) == 1 and str(results) in warn[0]
    for n in (2, 3, 4, 5):
        assert f" {n} (" in warn[0]
    after = [json.loads(x) for x in results.read_bytes().splitlines()]
    assert sorted(r["key"] for r in after) == sorted(r["key"] for r in before)      # each episode exactly once
    rerun = {r["key"] for r in after if r["run_id"] != before[0]["run_id"]}
    assert rerun == {before[i]["key"] for i in (1, 2, 3, 4)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 6


def test_a_second_record_of_an_episode_with_other_content_is_set_aside_and_named(tmp_path):
    """A later line with an episode's key and other content (journals merged by hand, a second writer) was dropped
    without a word, whichever it was: the first record is kept (what every summary of the file counted), the later
    one moved to results.jsonl.rejected and named, with whether the two disagree on the outcome; an identical copy
    is just dropped."""
    p = tmp_path / "results.jsonl"
    lines = [rec(0, 0, True, 10), rec(1, 0), rec(0, 0, False, 60), dict(rec(1, 0), wall_s=2.5), rec(1, 0)]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    j = Journal(p)
    assert j.records["s/0/0"]["success"] is True and "wall_s" not in j.records["s/1/0"]
    assert [n for n, _ in j.conflicts] == [3, 4] and not j.bad_lines
    msg = j.conflicts_message()
    assert "\n" not in msg and j.warnings() == [msg]
    assert "line 3: episode s/0/0 again (first at line 1), a different outcome" in msg
    assert "line 4: episode s/1/0 again (first at line 2), the same outcome, other details" in msg
    assert "first record of each episode is kept" in msg and str(j.rejected_path) in msg
    j.append(rec(2, 0))                       # the first append sets the lines aside (no tidy() called)
    assert [json.loads(x) for x in j.rejected_path.read_text().splitlines()] == lines[2:4]
    assert len(p.read_text().splitlines()) == 3
    assert not Journal(p).warnings()          # the file is clean again
