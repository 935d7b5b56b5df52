"""The episode plan: suite x tasks x trials, each planned episode with a stable key and seed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Episode:
    index: int          # position in the plan (stable across runs of the same config)
    suite: str
    task_id: int
    trial: int          # init-state index
    task: str = ""      # instruction text

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.task_id}/{self.trial}"


def make_plan(suite: str, task_ids: list[int], trials: int, trial_start: int = 0,
              instructions: dict[int, str] | None = None) -> list[Episode]:
    """Task-major order: all trials of task 0, then task 1, ..."""
    instructions = instructions or {}
    plan = []
    for t in task_ids:
        for k in range(trial_start, trial_start + trials):
            plan.append(Episode(len(plan), suite, int(t), int(k), instructions.get(int(t), "")))
    return plan


def plan_for_tasks(suite: str, tasks, task_ids: list[int] | None, trials: int, trial_start: int = 0,
                   where: str = "") -> list[Episode]:
    """The plan over an env's TaskInfo list, with the user's task ids and trial range checked (UserError)."""
    from wamkit.core.errors import UserError

    ids = list(range(len(tasks))) if task_ids is None else list(task_ids)
    dup = sorted({t for t in ids if ids.count(t) > 1})
    if dup:
        raise UserError(f"task {dup[0]} is listed twice in tasks=; each task is evaluated once per trial")
    bad = [t for t in ids if not 0 <= t < len(tasks)]
    if bad:
        raise UserError(f"unknown task {bad[0]}{' for ' + where if where else ''}; "
                        f"valid choices: 0..{len(tasks) - 1}")
    max_trials = min(t.num_trials for t in tasks)
    if trial_start + trials > max_trials:
        raise UserError(f"{trials} trials from init state {trial_start} exceed the {max_trials} init states per task"
                        f"{' of ' + where if where else ''}")
    return make_plan(suite, ids, trials, trial_start, {i: t.instruction for i, t in enumerate(tasks)})


def step_seed(base_seed: int, episode: Episode, step: int) -> int:
    """Noise seed of the policy call at env step `step` of `episode`: a function of (episode, step) only,
    never of the batch it lands in, so results do not depend on the schedule."""
    h = hashlib.blake2b(f"{base_seed}|{episode.key}|{step}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF
