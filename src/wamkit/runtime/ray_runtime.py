"""Env workers and action-server workers as Ray actors, behind the same contracts as the local ones
(`wamkit.envs.contracts.EnvWorkerLike`, `wamkit.serve.contracts.ServerWorkerLike`).

    workers = make_ray_env_workers("metaworld", {"suite": "mt"}, n=8, ray_opts={"placement": "spread"})
    # each: start(), .spec, .tasks, await reset(task_id, trial), await execute(chunk, ...), sync twins,
    #       kill(), restart(), close(), alive, index; raises EnvWorkerCrashed when its actor (or node) dies

- One actor per env (`wamkit.envs.make_env` inside it), requesting `num_cpus_per_env` CPUs and `memory_gb_per_env`
  of Ray's logical memory, each in its own bundle of one placement group (SPREAD or PACK over the nodes).
- Observations come back as the actor call's return value: Ray pickles the dataclass with out-of-band numpy
  buffers; small returns travel inline with the reply, large ones (images) through the object store, and the
  driver copies the arrays out (`ray.copy_obs=false`: zero-copy read-only views). The scheduler awaits the
  ObjectRefs directly on its asyncio loop.
- Actors are never restarted by Ray (max_restarts=0): a dead actor or a lost node surfaces as `EnvWorkerCrashed`;
  the driver-side scheduler calls `restart()` (a new actor in the same bundle; after a node loss Ray re-places the
  bundle on a node with room) and re-runs the episode.

Action servers: `make_ray_server_worker(ray_opts, **kw)` -> a `RayServerWorker` with the ServerWorker interface
(start(), wait_healthy(timeout), url, healthy(), stop(), restart(), ensure_healthy()). Each is an actor holding one GPU
(num_gpus_per_server) that runs `wamkit.serve.workers.WamkitServerWorker` (the `wamkit serve` process) on its node
and reports the URL.
The server binds 127.0.0.1 when its node is on the driver's host, else the node's IP (the driver must reach it over
HTTP; use a server token on shared networks). It logs to a file in its node's Ray session log dir; stop() copies the
tail to the driver (OUT/server-<i>.log) and removes the file. A replacement actor (after a crash) asks for the same
node and port, so the URL usually survives; `url` is always the current one.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.core.errors import UserError
from wamkit.core.lifecycle import StartClosingContext, StartStopContext
from wamkit.core.types import ChunkResult, Observation
from wamkit.runtime import ray_session
from wamkit.runtime.ray_session import RayOptions

log = logging.getLogger(__name__)


def _crashed(index: int, msg: str) -> Exception:
    from wamkit.envs.worker import EnvWorkerCrashed

    return EnvWorkerCrashed(index, msg)


def _env_error(index: int, e) -> Exception:
    """The env raised inside its actor (the actor lives on): EnvWorkerError, as the local worker raises."""
    from wamkit.envs.worker import EnvWorkerError

    cause = getattr(e, "cause", None)
    exc_type = type(cause).__name__ if cause is not None else type(e).__name__
    msg = str(cause) if cause is not None else str(e)
    return EnvWorkerError(index, exc_type, msg, getattr(e, "traceback_str", "") or "")


def _crash_exceptions() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError",
             "WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "ObjectFetchTimedOutError",
             "ReferenceCountingAssertionError", "ObjectReconstructionFailedError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


# ---------------------------------------------------------------------------------------------------------------
# actors (classes made remote lazily, so importing this module does not import ray)


class _EnvActorImpl:
    """Hosts one Env in a Ray worker process. One call at a time (the env is not thread-safe)."""

    def __init__(self, env: str, env_kwargs: dict[str, Any]):
        from wamkit.envs import make_env

        self.env = make_env(env, **env_kwargs)

    def info(self):
        import ray

        from wamkit.envs.render_backend import in_use

        ctx = ray.get_runtime_context()
        return {"spec": self.env.spec, "tasks": self.env.tasks(), "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "render": in_use(type(self.env))}

    def reset(self, task_id: int, trial: int) -> Observation:
        return self.env.reset(task_id, trial)

    def execute(self, actions: np.ndarray, render_every_step: bool, run_to_max_steps: bool) -> ChunkResult:
        from wamkit.envs.base import timed_execute

        return timed_execute(self.env, actions, render_every_step=render_every_step,
                             run_to_max_steps=run_to_max_steps)   # (the reply's serialization by Ray not in worker_s)

    def echo(self, obs: Observation) -> Observation:
        """Round-trip probe for benchmarks: returns what it was given."""
        return obs

    def make_obs(self, cameras: int, size: int, state_dim: int) -> Observation:
        """Transfer probe for benchmarks: a fresh observation of the given shape."""
        rng = np.random.default_rng(0)
        return Observation({f"cam{i}": rng.integers(0, 255, (size, size, 3), dtype=np.uint8) for i in range(cameras)},
                           rng.standard_normal(state_dim).astype(np.float32), "probe")

    def close(self) -> None:
        self.env.close()


class _ServerActorImpl:
    """Runs one `wamkit serve` process (through WamkitServerWorker) on this actor's node."""

    def __init__(self, worker_kwargs: dict[str, Any], driver_ip: str, host: str | None):
        import ray

        from wamkit.serve.workers import WamkitServerWorker

        self.node_ip = ray.util.get_node_ip_address()
        self.host = host or ("127.0.0.1" if self.node_ip == driver_ip else self.node_ip)
        kw = dict(worker_kwargs)
        self.own_log: str | None = None
        if not kw.get("log_path"):   # not loose in the node's /tmp: in Ray's session logs, removed at stop()
            kw["log_path"] = self.own_log = _node_log_path()
        self.worker = WamkitServerWorker(host=self.host, **kw)

    def start(self, port: int | None = None) -> None:
        if port and not self.worker.running():
            # a replacement on the same node takes the old port, so URLs handed out stay valid; the worker may
            # still re-pick a free one if another process holds it (auto_port)
            self.worker.port = int(port)
        self.worker.start()

    def wait_healthy(self, timeout: float) -> str:
        self.worker.wait_healthy(timeout)
        return self.worker.url

    def url(self) -> str:
        return self.worker.url

    def healthy(self) -> bool:
        return bool(self.worker.healthy())

    def restart(self) -> None:
        self.worker.restart()

    def stop(self) -> str:
        """Stop the server; its log tail (the driver writes it to OUT/server-<i>.log, under a line naming this node),
        the log file removed if this actor chose it."""
        self.worker.stop()
        tail = self.worker.log_tail(None, whole_log="the whole log was not kept" if self.own_log else None)
        if self.own_log:
            try:
                os.unlink(self.own_log)
            except OSError:
                pass
        return tail

    def info(self) -> dict[str, Any]:
        import ray

        return {"node_ip": self.node_ip, "host": self.host, "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": ray.get_gpu_ids(), "pid": os.getpid(), "log_path": str(self.worker.log_path)}


def _node_log_path() -> str:
    """A fresh log file in this node's Ray session log dir (a private Ray's goes with its temp dir; a cluster's
    with Ray's own log rotation), else in the temp dir."""
    import tempfile

    try:
        import ray

        d = ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - a private Ray attribute: fall back to the temp dir
        d = None
    fd, path = tempfile.mkstemp(prefix="wamkit-server-", suffix=".log", dir=d)
    os.close(fd)
    return path


def _cannot_place(what: str, why: str, fix: str) -> str:
    """The one wording of "Ray cannot place these actors": what (and since when), why (the resources), what to
    change."""
    return f"Ray could not place {what}: {why}; {fix}"


def _amounts(resources: dict[str, float], keys) -> str:
    """'CPU=2, GPU=0, memory=3.1 GiB': Ray resource amounts (memory in bytes) as messages show them."""
    return ", ".join(f"memory={resources.get(k, 0) / 2**30:.1f} GiB" if k == "memory"
                     else f"{k}={resources.get(k, 0):g}" for k in keys)


def _actor_error(e: BaseException) -> BaseException:
    """What an actor method raised, as the driver should raise it: the original exception (a wamkit UserError stays
    one line), not RayTaskError's text (remote traceback, ANSI colours)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception):
        return cause
    first = next((ln for ln in _strip_ansi(str(e)).splitlines() if ln.strip()), type(e).__name__)
    return RuntimeError(first)


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


_remote_cache: dict[str, Any] = {}


def _remote(name: str):
    import ray

    if name not in _remote_cache:
        impl = {"env": _EnvActorImpl, "server": _ServerActorImpl}[name]
        _remote_cache[name] = ray.remote(max_restarts=0, max_task_retries=0)(impl)
    return _remote_cache[name]


# ---------------------------------------------------------------------------------------------------------------
# env workers


class RayEnvPool:
    """What the env workers of one evaluation share: the Ray session, the placement group, the options."""

    def __init__(self, n: int, opts: RayOptions):
        import ray
        from ray.util.placement_group import placement_group

        self.opts = opts
        self.session = ray_session.acquire(opts)
        self.open = n
        self._lock = threading.Lock()
        bundle: dict[str, float] = {}
        if opts.num_cpus_per_env > 0:      # Ray refuses a bundle holding a 0 resource
            bundle["CPU"] = opts.num_cpus_per_env
        if opts.memory_gb_per_env > 0:
            bundle["memory"] = int(opts.memory_gb_per_env * 2**30)
        self.pg = None
        if self.session.started_here and not self._fits(n, bundle):   # a private Ray gets no more nodes
            msg = self._no_room(n, bundle, "at all")      # (while Ray is up: release may shut it down)
            ray_session.release(self.session)
            raise UserError(msg) from None
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=opts.placement.upper())
        try:
            ray.get(self.pg.ready(), timeout=opts.startup_timeout_s)
        except Exception as e:  # noqa: BLE001
            msg = self._no_room(n, bundle, f"within {opts.startup_timeout_s:.0f} s ({type(e).__name__})")
            self.pg_remove()
            ray_session.release(self.session)
            raise UserError(msg) from None

    @staticmethod
    def _fits(n: int, bundle: dict[str, float]) -> bool:
        import ray

        total = ray.cluster_resources()
        return all(n * v <= total.get(k, 0) for k, v in bundle.items())

    def _no_room(self, n: int, bundle: dict[str, float], when: str) -> str:
        import ray

        return _cannot_place(f"{n} env workers of {bundle} ({self.opts.placement}) {when}",
                             f"the cluster has {_amounts(ray.cluster_resources(), ('CPU', 'memory'))}",
                             "lower num_envs, ray.num_cpus_per_env or ray.memory_gb_per_env, or add nodes")

    def pg_remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.pg is None:
            return
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass

    def worker_closed(self) -> None:
        with self._lock:
            self.open -= 1
            last = self.open == 0
        if last:
            self.pg_remove()
            ray_session.release(self.session)


class RayEnvWorker(StartClosingContext):
    """An env worker backed by a Ray actor (the `wamkit.envs.contracts.EnvWorkerLike` contract, as the local
    `wamkit.envs.worker.EnvWorker`)."""

    def __init__(self, env: str, env_kwargs: dict[str, Any], index: int, pool: RayEnvPool):
        self.env_name, self.env_kwargs, self.index, self.pool = env, dict(env_kwargs), index, pool
        self.spec = None
        self.tasks = None
        self.render: dict | None = None
        self.node_ip: str | None = None
        self.node_id: str | None = None
        self.pid: int | None = None
        self.restarts = 0
        self._actor = None
        self._dead = True
        self._closed = False
        self._crash_types = _crash_exceptions()

    # ---- lifecycle
    def start(self) -> "RayEnvWorker":
        """Create the actor in this worker's bundle and block until its env is built (spec and tasks known)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._actor is not None and not self._dead:
            return self
        if self._closed:
            raise RuntimeError(f"env worker {self.index} is closed")
        o = self.pool.opts
        opts: dict[str, Any] = {
            "num_cpus": o.num_cpus_per_env,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pool.pg, placement_group_bundle_index=self.index % self.pool.pg.bundle_count,
                placement_group_capture_child_tasks=False),
        }
        if o.memory_gb_per_env > 0:
            opts["memory"] = int(o.memory_gb_per_env * 2**30)
        renv = o.runtime_env()
        if renv:
            opts["runtime_env"] = renv
        # An actor that dies before its env is built, without its constructor failing, was placed on a node that
        # just died (its bundle not yet re-placed by Ray): try again until the startup deadline.
        deadline = time.monotonic() + o.startup_timeout_s
        delay = 0.25
        while True:
            self._actor = _remote("env").options(**opts).remote(self.env_name, self.env_kwargs)
            left = max(1.0, deadline - time.monotonic())
            try:
                info = ray.get(self._actor.info.remote(), timeout=left)
                break
            except ray.exceptions.GetTimeoutError:
                self._kill_actor()
                raise _crashed(self.index, f"Ray actor not ready within {o.startup_timeout_s:.0f} s (no room for "
                                           "its placement-group bundle?)") from None
            except ray.exceptions.RayTaskError as e:
                self._kill_actor()
                raise _crashed(self.index, f"could not build env {self.env_name!r} in its Ray actor: {e}") from None
            except self._crash_types as e:
                self._kill_actor()
                if getattr(e, "actor_init_failed", False) or time.monotonic() + delay >= deadline:
                    raise _crashed(self.index, f"could not start env {self.env_name!r} in a Ray actor: {e}") from None
                log.warning("env worker %d: new actor died before it was ready (%s); retrying in %.1f s",
                            self.index, type(e).__name__, delay)
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
        self.spec, self.tasks, self.render = info["spec"], list(info["tasks"]), info.get("render")
        self.node_ip, self.node_id, self.pid = info["node_ip"], info["node_id"], info["pid"]
        self._dead = False
        return self

    def restart(self) -> "RayEnvWorker":
        """A new actor (in the same bundle: the same node, or another one after a node loss)."""
        self._kill_actor()
        self.restarts += 1
        return self.start()

    def kill(self) -> None:
        """Kill the actor (as a crash would): the next call raises EnvWorkerCrashed until restart()."""
        self._kill_actor()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the env to close, kill the actor; the last worker of the pool frees the bundles. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._actor is not None and not self._dead:
            import ray

            try:
                ray.get(self._actor.close.remote(), timeout=timeout)
            except Exception:  # noqa: BLE001
                pass
        self._kill_actor()
        self.pool.worker_closed()

    def _kill_actor(self) -> None:
        import ray

        a, self._actor, self._dead = self._actor, None, True
        if a is not None:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass

    @property
    def alive(self) -> bool:
        if self._dead or self._actor is None:
            return False
        try:
            import ray._private.state as state

            info = state.actors(actor_id=self._actor._actor_id.hex())
            return info.get("State") not in ("DEAD",)
        except Exception:  # noqa: BLE001 - the GCS lookup is best effort; the next call tells for sure
            return True

    @property
    def actor(self):
        return self._actor

    # ---- calls
    def _crashed(self, e: BaseException) -> BaseException:
        self._dead = True
        first = str(e).splitlines()[0] if str(e) else ""
        return _crashed(self.index, f"its Ray actor (node {self.node_ip}, pid {self.pid}) died: "
                                    f"{type(e).__name__}: {first}")

    def _check(self) -> None:
        if self._actor is None or self._dead:
            raise _crashed(self.index, "its Ray actor is not running (restart() it)")

    def _fix_obs(self, obs: Observation | None) -> Observation | None:
        if obs is not None and self.pool.opts.copy_obs:
            obs = Observation({k: np.array(v) for k, v in obs.images.items()},
                              None if obs.state is None else np.array(obs.state), obs.task)
        return obs

    def _fix_chunk(self, res: ChunkResult) -> ChunkResult:
        res.obs = self._fix_obs(res.obs)
        if res.frames and self.pool.opts.copy_obs:
            res.frames = [np.array(f) for f in res.frames]
        return res

    async def _await(self, ref):
        import ray

        try:
            return await ref
        except self._crash_types as e:
            raise self._crashed(e) from None
        except ray.exceptions.RayTaskError as e:   # the env itself raised (the actor lives on)
            raise _env_error(self.index, e) from None

    def _get(self, ref):
        import ray

        try:
            return ray.get(ref)
        except self._crash_types as e:
            raise self._crashed(e) from None
        except ray.exceptions.RayTaskError as e:
            raise _env_error(self.index, e) from None

    async def reset(self, task_id: int, trial: int) -> Observation:
        self._check()
        return self._fix_obs(await self._await(self._actor.reset.remote(int(task_id), int(trial))))

    async def execute(self, actions: np.ndarray, render_every_step: bool = False,
                      run_to_max_steps: bool = False) -> ChunkResult:
        self._check()
        res = await self._await(self._actor.execute.remote(np.asarray(actions, np.float32), bool(render_every_step),
                                                           bool(run_to_max_steps)))
        return self._fix_chunk(res)

    def reset_sync(self, task_id: int, trial: int) -> Observation:
        self._check()
        return self._fix_obs(self._get(self._actor.reset.remote(int(task_id), int(trial))))

    def execute_sync(self, actions: np.ndarray, render_every_step: bool = False,
                     run_to_max_steps: bool = False) -> ChunkResult:
        self._check()
        res = self._get(self._actor.execute.remote(np.asarray(actions, np.float32), bool(render_every_step),
                                                   bool(run_to_max_steps)))
        return self._fix_chunk(res)

    def __repr__(self) -> str:
        return f"RayEnvWorker(index={self.index}, env={self.env_name!r}, node={self.node_ip}, pid={self.pid})"


def make_ray_env_workers(env: str, env_kwargs: dict[str, Any], n: int,
                         ray_opts: dict[str, Any] | RayOptions | None = None) -> list[RayEnvWorker]:
    """n env workers as Ray actors (not started: call start() on each, as with local EnvWorkers).

    Connects to (or starts) Ray and reserves one placement-group bundle per worker; the last worker's close()
    frees the bundles and shuts down a Ray started here."""
    if n < 1:
        raise UserError("need at least one env worker")
    opts = RayOptions.from_any(ray_opts)
    pool = RayEnvPool(n, opts)
    return [RayEnvWorker(env, env_kwargs, i, pool) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# action-server workers


class RayServerWorker(StartStopContext):
    """An action server (`wamkit serve`) launched by a Ray actor holding one GPU (the
    `wamkit.serve.contracts.ServerWorkerLike` contract, as the local ServerWorker).

    Holds the Ray session from construction until stop(). A restart that must replace the actor (it or its node
    died) asks for the same node and port, so `url` usually stays the same; when it cannot (another node, the port
    taken), `url` is the new server's URL from then on: clients re-read it after ensure_healthy() returned True.
    `log_path` (on the driver): where stop() appends the server's log tail (e.g. OUT/server-<i>.log)."""

    health_path = "/health"

    def __init__(self, worker_kwargs: dict[str, Any], opts: RayOptions | dict | None = None, index: int = 0):
        self.worker_kwargs, self.opts, self.index = dict(worker_kwargs), RayOptions.from_any(opts), index
        # the log path is the driver's (OUT/server-<i>.log): the server on its node logs to a file of its own
        log_path = self.worker_kwargs.pop("log_path", None)
        self.log_path = Path(log_path) if log_path else None
        self.session = ray_session.acquire(self.opts)
        self._actor = None
        self._url: str | None = None
        self.node_ip: str | None = None
        self.node_id: str | None = None
        self.host: str | None = None
        self.gpu_ids: list = []
        self.starts = 0
        self.default_start_timeout = self.opts.startup_timeout_s   # wait_healthy(None); the eval may raise it
        self._released = False
        self._crash_types = _crash_exceptions()

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("server not started (call start() and wait_healthy())")
        return self._url

    @property
    def token(self) -> str | None:
        """The token its server requires (what a client sends): it travels in the actor's arguments and reaches the
        `wamkit serve` process in its environment (WamkitServerWorker), never a command line or a file."""
        return self.worker_kwargs.get("token")

    @property
    def actor(self):
        return self._actor

    def _actor_options(self) -> dict[str, Any]:
        o = self.opts
        opts: dict[str, Any] = {"num_gpus": o.num_gpus_per_server, "num_cpus": o.num_cpus_per_server}
        if o.memory_gb_per_server > 0:
            opts["memory"] = int(o.memory_gb_per_server * 2**30)
        renv = o.runtime_env()
        if renv:
            opts["runtime_env"] = renv
        return opts

    def start(self) -> "RayServerWorker":
        import ray

        if self._released:
            raise RuntimeError("server worker was stopped")
        if self._actor is not None:
            return self
        o, opts = self.opts, self._actor_options()
        old_node, old_port = self.node_id, self._port()
        if self.session.started_here:     # a private Ray gets no more nodes: refuse what it can never place
            self._check_fits(0.0)
            if old_node is None:          # (a replacement's CPU may still be held by the dead actor: not then)
                self._check_free()
        sched = dict(opts)
        if old_node is not None:   # a replacement: the same node if it is still there (soft)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            sched["scheduling_strategy"] = NodeAffinitySchedulingStrategy(old_node, soft=True)
        self._actor = _remote("server").options(**sched).remote(self.worker_kwargs, self.session.driver_ip,
                                                               o.server_host)
        try:
            info = ray.get(self._actor.info.remote(), timeout=o.startup_timeout_s)
            port = old_port if old_node is not None and info["node_id"] == old_node else None
            ray.get(self._actor.start.remote(port), timeout=o.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill_actor()
            self._check_fits(o.startup_timeout_s)
            raise UserError(self._placement_error(o.startup_timeout_s)) from None
        except ray.exceptions.RayTaskError as e:
            self._kill_actor()
            raise _actor_error(e) from None
        except self._crash_types as e:
            self._kill_actor()
            raise RuntimeError(f"server worker {self.index}: actor died while starting: {e}") from None
        self.node_ip, self.node_id, self.host = info["node_ip"], info["node_id"], info["host"]
        self.gpu_ids = info["gpu_ids"]
        self.starts += 1
        return self

    def _port(self) -> int | None:
        try:
            return int(self._url.rsplit(":", 1)[1]) if self._url else None
        except ValueError:
            return None

    def _check_fits(self, waited: float) -> None:
        """A UserError naming ray.num_gpus_per_server when the cluster has fewer GPUs than one server asks for."""
        import ray

        gpus = float(ray.cluster_resources().get("GPU", 0))
        need = self.opts.num_gpus_per_server
        if need > gpus:
            within = f" within {waited:.0f} s" if waited else ""
            raise UserError(_cannot_place(f"action server {self.index}{within}",
                                          f"ray.num_gpus_per_server={need:g} but the cluster has GPU={gpus:g}",
                                          "set ray.num_gpus_per_server=0 on a CPU-only cluster")) from None

    def _check_free(self) -> None:
        """On a private Ray (no node will join, and what this run holds stays held while it runs): refuse at once a
        first server that does not fit in what is free, instead of waiting ray.startup_timeout_s for nothing."""
        import ray

        free = ray.available_resources()
        need = {k: v for k, v in (("CPU", self.opts.num_cpus_per_server), ("GPU", self.opts.num_gpus_per_server),
                                  ("memory", self.opts.memory_gb_per_server * 2**30)) if v > 0}
        short = [k for k, v in need.items() if v > free.get(k, 0) + 1e-9]
        if short:
            keys = {"CPU": "ray.num_cpus_per_server", "GPU": "ray.num_gpus_per_server",
                    "memory": "ray.memory_gb_per_server"}
            have, lower = _amounts(free, short), " and ".join(keys[k] for k in short)
            raise UserError(_cannot_place(f"action server {self.index}",
                                          f"the local Ray has {have} free (the env workers hold the rest)",
                                          f"lower {lower} (0 is allowed), or num_envs")) from None

    def _placement_error(self, waited: float) -> str:
        import ray

        return _cannot_place(f"action server {self.index} ({self.opts.num_cpus_per_server:g} CPU, "
                             f"{self.opts.num_gpus_per_server:g} GPU) within {waited:.0f} s",
                             f"the cluster has {_amounts(ray.cluster_resources(), ('CPU', 'GPU'))}",
                             "lower ray.num_cpus_per_server, ray.num_gpus_per_server or ray.memory_gb_per_server, "
                             "or add nodes")

    def wait_healthy(self, timeout: float | None = None) -> "RayServerWorker":
        import ray

        timeout = self.default_start_timeout if timeout is None else float(timeout)
        if self._actor is None:
            raise RuntimeError("server was not started")
        try:
            self._url = ray.get(self._actor.wait_healthy.remote(timeout), timeout=timeout + 30)
        except ray.exceptions.RayTaskError as e:
            raise _actor_error(e) from None
        except self._crash_types as e:
            raise RuntimeError(f"server worker {self.index}: actor died: {e}") from None
        return self

    def healthy(self, timeout: float = 2.0) -> bool:
        """Health as the driver sees it: the server answers /health at its URL from here."""
        import httpx

        if self._actor is None or self._url is None:
            return False
        try:
            return httpx.get(self._url + self.health_path, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def restart(self, timeout: float | None = None) -> "RayServerWorker":
        """Restart the server process in its actor (same URL); a dead or hung actor (or node) is replaced by a new
        one, on the same node and port when possible (`url` tells). Each restart counts in `starts`."""
        import ray

        if self._actor is not None:
            try:
                ray.get(self._actor.restart.remote(), timeout=self.opts.startup_timeout_s)
                ray.get(self._actor.url.remote(), timeout=30)   # still there after the restart
            except ray.exceptions.RayTaskError as e:   # the server itself failed to start again
                raise _actor_error(e) from None
            except (*self._crash_types, ray.exceptions.GetTimeoutError):
                log.warning("server worker %d: its Ray actor died or hangs; starting a new one", self.index)
            else:
                self.wait_healthy(timeout)
                self.starts += 1
                return self
        self._kill_actor()
        self.start()
        return self.wait_healthy(timeout)

    def ensure_healthy(self, timeout: float | None = None) -> bool:
        """Restart the server if it died or stopped answering (as seen from here); True if a restart happened
        (then re-read `url`: a replacement actor may serve on another node or port)."""
        if self.healthy():
            return False
        self.restart(timeout)
        return True

    def stop(self) -> None:
        import ray

        if self._actor is not None:
            try:
                self._save_log(ray.get(self._actor.stop.remote(), timeout=60))
            except Exception:  # noqa: BLE001 - a dead actor: nothing to stop, its log is on its node
                pass
        self._kill_actor()
        if not self._released:
            self._released = True
            ray_session.release(self.session)

    def _save_log(self, tail: str) -> None:
        if not self.log_path or not tail:
            return
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a", encoding="utf-8", errors="replace") as f:
                f.write(f"=== Ray action server {self.index} on node {self.node_ip} (log tail)\n{tail}")
        except OSError as e:
            log.warning("could not write the server log %s: %s", self.log_path, e)

    def kill(self) -> None:
        """Kill the actor as a crash would (its server exits too: it watches its parent's pid)."""
        self._kill_actor()

    def _kill_actor(self) -> None:
        import ray

        a, self._actor = self._actor, None
        if a is not None:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass

    def __repr__(self) -> str:
        return f"RayServerWorker(url={self._url!r}, node={self.node_ip}, gpus={self.gpu_ids})"


def make_ray_server_worker(ray_opts: dict[str, Any] | RayOptions | None = None, **worker_kwargs) -> RayServerWorker:
    """One action server as a Ray actor (`ray.num_gpus_per_server` GPUs); worker_kwargs go to WamkitServerWorker
    (policy, policy_args, port, max_batch_size, max_wait_ms, token, ...). Not started: start(), wait_healthy()."""
    return RayServerWorker(worker_kwargs, ray_opts)


def make_ray_server_workers(n: int, ray_opts: dict[str, Any] | RayOptions | None = None,
                            **worker_kwargs) -> list[RayServerWorker]:
    """n action servers (one per GPU with the defaults), not started."""
    return [RayServerWorker(worker_kwargs, ray_opts, i) for i in range(n)]


def ray_server_worker_factory(ray_opts: dict[str, Any] | RayOptions | None = None):
    """A drop-in for the WamkitServerWorker class where the eval builds its server: factory(**kwargs) ->
    RayServerWorker (same kwargs: policy, policy_args, port, max_batch_size, max_wait_ms, token, log_path: the
    driver-side file its log tail is appended to at stop)."""
    opts = RayOptions.from_any(ray_opts)
    made = itertools.count()

    def factory(**worker_kwargs) -> RayServerWorker:
        return RayServerWorker(worker_kwargs, opts, next(made))

    return factory
