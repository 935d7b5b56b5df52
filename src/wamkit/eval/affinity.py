"""Which episode an env runs next: envs keep the scene they have loaded, spread over the tasks, and switch scenes
only where switching pays.

A LIBERO env that resets to another task rebuilds its scene (a *load*: 5-10 s on the H200 machine under load,
against ~0.3 s for the next episode of a loaded task, robosuite's soft reset). Three rules:

1. **Spread at the start.** Before the first episode the envs are given tasks in proportion to the queued episodes
   (`spread`: every task one env while envs last, then each next env to the task with the most episodes per env),
   keeping as many envs as possible on the task they have loaded (`assign`). Left alone, envs that all start on
   one task drain it together and then all load a new scene mid-run.
2. **Keep the task** while episodes of it are queued.
3. **Switch only where it pays.** An env whose task has no episode left takes a task that no running env is on, or
   one whose queued episodes it would help finish sooner counting its load (`worth_switching`, from the measured
   load and episode times); otherwise it stops: the envs already on that task run those episodes sooner than a new
   scene could. Until a load and an episode have been measured it always switches.

Which env runs an episode never changes the episode's result (seeds depend on the episode and env step only)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from wamkit.eval.plan import Episode


def queued_counts(queue) -> tuple[dict[int, int], dict[int, int]]:
    """(episodes per task, queue position of each task's first episode), in queue order."""
    count: dict[int, int] = {}
    first: dict[int, int] = {}
    for k, ep in enumerate(queue):
        first.setdefault(ep.task_id, k)
        count[ep.task_id] = count.get(ep.task_id, 0) + 1
    return count, first


def spread(counts: dict[int, int], n_envs: int) -> dict[int, int]:
    """Envs per task: one per task (in `counts` order) while envs last, then each next env to the task with the most
    episodes per env (this minimizes the largest per-env share)."""
    k = {t: 0 for t in counts}
    order = list(counts)
    for j in range(n_envs):
        if j < len(order):
            k[order[j]] += 1
        else:
            t = max(order, key=lambda t: (counts[t] / k[t], -order.index(t)))
            k[t] += 1
    return k


def assign(loaded: dict[int, int], counts: dict[int, int], n_envs: int) -> dict[int, int]:
    """env -> task following `spread`, moving as few envs off their loaded task as possible."""
    target = spread(counts, n_envs)
    kept: dict[int, int] = {}
    out: dict[int, int] = {}
    free: list[int] = []
    for i in range(n_envs):
        t = loaded.get(i)
        if t in target and kept.get(t, 0) < target[t]:
            kept[t] = kept.get(t, 0) + 1
            out[i] = t
        else:
            free.append(i)
    need = [t for t in counts for _ in range(target[t] - kept.get(t, 0))]
    out.update(zip(free, need))
    return out


def worth_switching(queued: int, on: int, load_s: float, episode_s: float) -> bool:
    """Would one more env, loading the task's scene now, finish the task's `queued` episodes sooner than the `on`
    envs already on it? Fluid estimate: without it the last ends at about E/2 (what is left of the current episodes)
    + q E / on; with it, the same work is shared by on + 1 envs, one of them starting after its load L, and it ends
    no sooner than L + E (the new env's first episode)."""
    if on <= 0:
        return True
    e = episode_s
    without = e / 2 + queued * e / on
    with_it = max(load_s + e, (on * e / 2 + queued * e + load_s) / (on + 1))
    return with_it < without


class TaskAffinity:
    """The env -> task bookkeeping of one Scheduler run (rules in the module docstring)."""

    def __init__(self, loaded: dict[int, int], load_hint_s: float | None = None):
        self.env_task: dict[int, int] = dict(loaded)   # env -> the task it runs (its scene, once reset)
        self.scene: dict[int, int] = dict(loaded)      # env -> the task whose scene it has built
        self.stopped: set[int] = set()                # envs that stopped: no task worth switching to
        self.load_samples: deque[float] = deque([load_hint_s] if load_hint_s else [], maxlen=50)
        self.episode_samples: deque[float] = deque(maxlen=50)
        self.loads = 0
        self.load_seconds = 0.0                       # seconds of the scene loads of this run
        self._began: dict[int, float] = {}            # env -> monotonic end of the reset of its current episode
        self._loading: dict[int, float] = {}          # env -> monotonic start of the scene load under way

    def start(self, queue, n_envs: int) -> None:
        count, _ = queued_counts(queue)
        if n_envs > 1 and count and n_envs >= len(count):
            self.env_task.update(assign(self.scene, count, n_envs))

    def next_episode(self, i: int, queue: deque[Episode]) -> Episode | None:
        if not queue:
            return None
        count, first = queued_counts(queue)
        task = self.env_task.get(i)
        if task not in count:
            on: dict[int, int] = {}
            for j, t in self.env_task.items():
                if j != i and j not in self.stopped:
                    on[t] = on.get(t, 0) + 1
            cand = list(count)
            load = self.load_estimate()
            if load is not None and self.episode_samples:
                epi = statistics.median(self.episode_samples)
                cand = [t for t in count if worth_switching(count[t], on.get(t, 0), load, epi)]
            if not cand:
                self.stopped.add(i)
                self.env_task.pop(i, None)
                return None
            task = max(cand, key=lambda t: (count[t] / (1 + on.get(t, 0)), -first[t]))
            self.env_task[i] = task
        k = first[task]
        ep = queue[k]
        del queue[k]
        return ep

    def load_estimate(self) -> float | None:
        """Seconds a scene load takes: the median of those done, else the longest one under way so far (a lower
        bound), else None (unknown)."""
        if self.load_samples:
            return statistics.median(self.load_samples)
        if self._loading:
            return time.monotonic() - min(self._loading.values())
        return None

    def reset_begun(self, i: int, task: int) -> bool:
        """Env i starts its reset to `task`: True where it loads a scene (another task than the one it has built)."""
        if self.scene.get(i) != task:
            self._loading[i] = time.monotonic()
            return True
        return False

    def loads_under_way(self) -> dict[int, float]:
        """env -> when its scene load under way is predicted to end (monotonic: its start + the median load done so
        far); empty until a load has been measured (or hinted by the workers: a fresh run's first loads all start
        together, and nothing says yet how long they take)."""
        if not self.load_samples or not self._loading:
            return {}
        load = self.load_estimate()   # the median of the loads done
        return {i: t0 + load for i, t0 in self._loading.items()}

    def reset_done(self, i: int, task: int, seconds: float) -> None:
        self._loading.pop(i, None)
        if self.scene.get(i) != task:
            self.load_samples.append(seconds)
            self.loads += 1
            self.load_seconds += seconds
        self.scene[i] = task
        self._began[i] = time.monotonic()

    def episode_done(self, i: int) -> None:
        """Env i's episode ended: its time from the end of its reset goes to the episode samples."""
        if i in self._began:
            self.episode_samples.append(time.monotonic() - self._began.pop(i))

    def forget(self, i: int) -> None:
        """A restarted env: a fresh process with no scene (its episode is re-run on it)."""
        self.scene.pop(i, None)
        self._loading.pop(i, None)
