"""Summary of an evaluation (OUT/summary.json): the results contract later issues keep."""

from __future__ import annotations

from typing import Any

from wamkit.core.config import is_number


def summarize(records: list[dict[str, Any]], *, wall_s: float, config: dict[str, Any], versions: dict[str, Any],
              inference_obs: int = 0, extra: dict[str, Any] | None = None,
              served_policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """records: per-episode results (success, steps, task_id, ...). Throughput is over this run's wall time.
    served_policy: what the server(s) at server.url served (ServerInference.served_policy: policy, name, model,
    model_path, url): kept as `served_policy`, and the summary's config.policy names it (the run's `policy` key
    names nothing when the policy runs in a server the evaluation did not start; the report shows config.policy)."""
    records = sorted(records, key=lambda r: (r["suite"], r["task_id"], r["trial"]))
    per_task: dict[str, dict[str, Any]] = {}
    for r in records:
        t = per_task.setdefault(str(r["task_id"]), {"task": r.get("task", ""), "episodes": 0, "successes": 0,
                                                   "steps": 0})
        t["episodes"] += 1
        t["successes"] += int(bool(r["success"]))
        t["steps"] += int(r["steps"])
        chunks, sim_s = r.get("chunks"), r.get("sim_s")
        if type(chunks) is int and chunks > 0 and isinstance(sim_s, (int, float)):   # (older records: none)
            t["chunks"] = t.get("chunks", 0) + chunks
            t["sim_s"] = t.get("sim_s", 0.0) + float(sim_s)
    for t in per_task.values():
        t["success_rate"] = t["successes"] / t["episodes"] if t["episodes"] else 0.0
        t["mean_steps"] = t.pop("steps") / t["episodes"] if t["episodes"] else 0.0
        if "chunks" in t:     # the task's pace: its chunks' mean time as the evaluating process saw it
            t["chunk_ms"] = 1000.0 * t.pop("sim_s") / t.pop("chunks")
    n = len(records)
    succ = sum(int(bool(r["success"])) for r in records)
    run_records = [r for r in records if r.get("run_id") == (extra or {}).get("run_id")] if extra else records
    env_steps = sum(int(r.get("env_steps", r["steps"])) for r in run_records)
    eps = len(run_records)
    out = {
        "episodes": n,
        "successes": succ,
        "success_rate": succ / n if n else 0.0,
        "per_task": dict(sorted(per_task.items(), key=lambda kv: int(kv[0]))),
        "throughput": {
            "wall_s": wall_s,
            "episodes_this_run": eps,
            "env_steps": env_steps,
            "episodes_per_hour": eps / wall_s * 3600 if wall_s > 0 else 0.0,
            "env_steps_per_s": env_steps / wall_s if wall_s > 0 else 0.0,
            "inference_obs_per_s": inference_obs / wall_s if wall_s > 0 else 0.0,
        },
        "config": config,
        "versions": versions,
    }
    if served_policy:
        out["served_policy"] = served_policy
        out["config"] = {**config, "policy": served_policy.get("policy") or config.get("policy"),
                         "served_policy": served_policy}
    if extra:
        out.update({k: v for k, v in extra.items() if k != "run_id"})
    return out


def task_chunk_ms(row: dict[str, Any]) -> float | None:
    """A per_task row's mean chunk in ms (its pace), None where the summary predates the field."""
    v = row.get("chunk_ms")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def chunk_ms_text(row: dict[str, Any]) -> str:
    """task_chunk_ms as a table cell: '9.5', or '' without it."""
    ms = task_chunk_ms(row)
    return "" if ms is None else f"{ms:.1f}"


def outcome_view(records: list[dict[str, Any]]) -> dict[str, tuple[bool, int]]:
    """key -> (success, steps): what must not depend on the schedule."""
    return {r["key"]: (bool(r["success"]), int(r["steps"])) for r in records}


def load_summary(out) -> dict:
    """OUT/summary.json of an evaluation output directory, checked for what the reports read (UserError, one line
    naming the directory or the field: a hand-edited summary or another tool's was a KeyError traceback)."""
    import json
    from pathlib import Path

    from wamkit.core.errors import UserError

    p = Path(out) / "summary.json"
    if not p.exists():
        if (Path(out) / "results.jsonl").exists():
            raise UserError(f"no summary.json in {out}: the evaluation did not finish; `wamkit eval ... resume=true` "
                            f"with the same keys and out={out} finishes it and writes the summary")
        raise UserError(f"no summary.json in {out} (is it an evaluation output directory?)")
    try:
        s = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{p} cannot be read ({type(e).__name__}: {e}); `wamkit eval ... resume=true` into {out} "
                        f"writes it again from results.jsonl") from None
    if not isinstance(s, dict):
        raise UserError(f"{p} is not a summary (a JSON object); `wamkit eval ... resume=true` writes it again")
    problem = summary_problem(s)
    if problem:
        raise UserError(f"{p}: {problem} (not a summary this wamkit wrote?); `wamkit eval ... resume=true` writes "
                        f"it again from results.jsonl")
    return s


SUMMARY_COUNTS = ("episodes", "successes", "success_rate")
THROUGHPUT_KEYS = ("episodes_this_run", "wall_s", "episodes_per_hour", "env_steps_per_s", "inference_obs_per_s")


def summary_problem(s: dict) -> str | None:
    """The first field the reports need that is missing or of the wrong type ("field per_task.3.episodes: ..."),
    else None."""
    def bad(d, keys, where):
        for k in keys:
            if not is_number(d.get(k)):
                return f"field {where}{k}: expected a number, got {d.get(k)!r}"
        return None

    checks = [bad(s, SUMMARY_COUNTS, "")]
    per_task, th, sch = s.get("per_task"), s.get("throughput"), s.get("scheduler", {})
    if not isinstance(per_task, dict):
        return f"field per_task: expected an object of tasks, got {type(per_task).__name__}"
    for tid, row in per_task.items():
        if not isinstance(row, dict):
            return f"field per_task.{tid}: expected an object, got {type(row).__name__}"
        checks.append(bad(row, SUMMARY_COUNTS, f"per_task.{tid}."))
    if not isinstance(th, dict):
        return f"field throughput: expected an object, got {type(th).__name__}"
    checks.append(bad(th, THROUGHPUT_KEYS, "throughput."))
    if not isinstance(sch, dict):
        return f"field scheduler: expected an object, got {type(sch).__name__}"
    return next((c for c in checks if c), None)