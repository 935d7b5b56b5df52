"""runtime=ray on a real local multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two worker nodes, each its
own raylet, on this machine), MetaWorld envs, token auth on.

- the same episode plan gives per-episode results identical to runtime=local;
- env actors spread over nodes (or pack onto one) as asked;
- an env actor killed mid-run (ray.kill) and a whole node lost mid-run: every episode still finishes exactly once;
- an action server launched by a Ray actor answers over HTTP and dies with its actor;
- no Ray process outlives the module (checked in the fixture's teardown against our temp dir).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ray = pytest.importorskip("ray")

GiB = 2**30
EVAL_ARGS = ["env=metaworld", "suite=mt", "tasks=3,4", "trials=2", "policy=metaworld-expert", "horizon=4",
             "max_steps=80", "image_size=32", "mode=auto", "num_envs=2", "progress=false", "seed=3"]
RAY_ARGS = ["runtime=ray", "ray.num_cpus_per_env=1", "ray.memory_gb_per_env=0.5", "ray.placement=spread"]


def _procs_mentioning(text: str) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{d.name}: {cmd[:160]}")
    return out


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from wamkit.runtime.ray_session import _refresh_ray_auth_config

    tmp = tempfile.mkdtemp(prefix="wkrt-")   # short: Ray's unix sockets live under it
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    os.environ.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _refresh_ray_auth_config()
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, include_dashboard=False, memory=2 * GiB, object_store_memory=120 * 2**20))
        for _ in range(2):
            c.add_node(num_cpus=2, memory=3 * GiB, object_store_memory=120 * 2**20)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        deadline = time.time() + 20
        while (left := _procs_mentioning(tmp)) and time.time() < deadline:
            time.sleep(0.5)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth_config()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes outlived the tests: {left}"


def _eval(tmp_path: Path, name: str, extra: list[str]):
    from wamkit.core.config import load_config
    from wamkit.eval.config import EvalConfig
    from wamkit.eval.runner import run_eval
    from wamkit.runtime import eval_runtime

    cfg = load_config(EvalConfig, None, [*EVAL_ARGS, f"out={tmp_path / name}", *extra])
    summary = run_eval(cfg, **eval_runtime(cfg))
    recs = [json.loads(line) for line in (tmp_path / name / "results.jsonl").read_text().splitlines() if line]
    return summary, recs


def _per_episode(recs):
    return {r["key"]: (r["success"], r["steps"], r["env_steps"]) for r in recs}


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory):
    """runtime=local results of the plan (no Ray involved)."""
    tmp = tmp_path_factory.mktemp("local")
    _, recs = _eval(tmp, "local", ["runtime=local"])
    assert len(recs) == 4
    return _per_episode(recs)


def test_eval_ray_matches_local(cluster, local_reference, tmp_path):
    summary, recs = _eval(tmp_path, "ray", RAY_ARGS)
    assert _per_episode(recs) == local_reference
    assert len(recs) == len({r["key"] for r in recs}) == 4
    assert summary["scheduler"]["env_restarts"] == 0
    assert any(r["success"] for r in recs)   # the expert solves some: the results are not trivially equal
    # each actor says what its MuJoCo renders with, as local env workers do
    assert sum(summary["scheduler"]["env_render"].values()) == summary["scheduler"]["num_envs"]


def test_placement_spread_and_pack(cluster):
    from wamkit.runtime.ray_runtime import make_ray_env_workers

    kw = {"suite": "mt", "image_size": 32, "max_steps": 10}
    for placement, distinct in (("spread", 2), ("pack", 1)):
        ws = make_ray_env_workers("metaworld", kw, 2, {"placement": placement, "memory_gb_per_env": 0.5})
        try:
            for w in ws:
                w.start()
            assert len({w.node_id for w in ws}) == distinct, placement
            obs = ws[0].reset_sync(3, 1)
            res = ws[0].execute_sync(np.zeros((3, 4), np.float32))
            assert obs.images["image"].shape == (32, 32, 3) and obs.state.shape == (39,)
            assert res.steps == 3 and res.obs is not None
        finally:
            for w in ws:
                w.close()
        # the placement group goes away with its last worker (asynchronously): all CPUs free again
        assert _wait_all_cpus_free(), ray.available_resources()


def _wait_all_cpus_free(timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"):
            return True
        time.sleep(0.2)
    return False


def test_actor_killed_mid_run(cluster, local_reference, tmp_path, monkeypatch):
    from wamkit.runtime import ray_runtime

    calls = {"n": 0, "killed": []}
    orig = ray_runtime.RayEnvWorker.execute

    async def execute(self, actions, render_every_step=False, run_to_max_steps=False):
        calls["n"] += 1
        if calls["n"] == 7:   # kill the actor while this call is in flight
            calls["killed"].append(self.pid)
            asyncio.get_running_loop().call_later(0.0, lambda a=self.actor: ray.kill(a, no_restart=True))
        return await orig(self, actions, render_every_step, run_to_max_steps)

    monkeypatch.setattr(ray_runtime.RayEnvWorker, "execute", execute)
    summary, recs = _eval(tmp_path, "killed", RAY_ARGS)
    assert calls["killed"], "the kill was not triggered"
    assert summary["scheduler"]["env_restarts"] >= 1
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == 4                 # every episode exactly once
    assert _per_episode(recs) == local_reference            # the re-run episode gives the same result
    assert max(r["attempts"] for r in recs) >= 2


def test_server_worker_as_actor(cluster):
    from wamkit.core.types import Observation
    from wamkit.runtime.ray_runtime import make_ray_server_worker
    from wamkit.protocol.client import SyncActionClient

    w = make_ray_server_worker({"num_gpus_per_server": 0, "num_cpus_per_server": 1}, policy="random",
                               policy_args={"action_dim": 4, "horizon": 3}, max_batch_size=4)
    try:
        w.start().wait_healthy(120)
        assert w.url.startswith("http://127.0.0.1:")     # node on the driver's host: loopback only
        assert w.healthy()
        obs = Observation({"image": np.zeros((8, 8, 3), np.uint8)}, np.zeros(4, np.float32), "reach")
        with SyncActionClient(w.url) as c:
            out = np.asarray(c.predict([obs, obs], [1, 2]))
        assert out.shape == (2, 3, 4)
        pid = ray.get(w.actor.info.remote())["pid"]
        w.kill()                                           # the actor dies; its server follows (parent_pid watch)
        deadline = time.time() + 30
        while w.healthy() and time.time() < deadline:
            time.sleep(0.5)
        assert not w.healthy()
        w.restart(120)                                     # a new actor and server
        assert w.healthy() and ray.get(w.actor.info.remote())["pid"] != pid
    finally:
        w.stop()
    assert not w.healthy()


def test_node_lost_mid_run(cluster, local_reference, tmp_path, monkeypatch):
    """Remove the raylet of a node holding an env actor while episodes run; the episode moves elsewhere."""
    from wamkit.runtime import ray_runtime

    state = {"n": 0, "removed": None}
    orig = ray_runtime.RayEnvWorker.execute
    nodes = {n.node_id: n for n in cluster.worker_nodes}

    async def execute(self, actions, render_every_step=False, run_to_max_steps=False):
        state["n"] += 1
        if state["n"] == 5 and self.node_id in nodes and state["removed"] is None:
            state["removed"] = self.node_id
            node = nodes[self.node_id]
            await asyncio.to_thread(cluster.remove_node, node, allow_graceful=False)
        return await orig(self, actions, render_every_step, run_to_max_steps)

    monkeypatch.setattr(ray_runtime.RayEnvWorker, "execute", execute)
    try:
        summary, recs = _eval(tmp_path, "nodelost", RAY_ARGS)
    finally:
        if state["removed"] is not None:      # put a node back for whatever runs next
            cluster.add_node(num_cpus=2, memory=3 * GiB, object_store_memory=120 * 2**20)
    assert state["removed"], "no env actor ran on a worker node"
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == 4
    assert _per_episode(recs) == local_reference
    assert summary["scheduler"]["env_restarts"] >= 1


