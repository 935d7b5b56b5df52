"""The worker families satisfy their Protocols (`wamkit.envs.contracts.EnvWorkerLike`,
`wamkit.serve.contracts.ServerWorkerLike`), and `with` means the same for every class that uses core.lifecycle.

Instances are checked with isinstance where they can be built without starting anything; every class (the Ray ones
too, without starting Ray) is also checked member by member: methods with compatible signatures (async where the
contract is async), properties, and data members set in a constructor."""

from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np
import pytest

from wamkit.core.lifecycle import ClosingContext, StartClosingContext, StartStopContext
from wamkit.envs.contracts import EnvWorkerLike
from wamkit.envs.worker import EnvWorker
from wamkit.runtime.ray_runtime import RayEnvWorker, RayServerWorker
from wamkit.serve.contracts import ServerWorkerLike
from wamkit.serve.workers import SGLangServerWorker, WamkitServerWorker


def _members(proto) -> dict[str, str]:
    """name -> 'data' | 'property' | 'method' | 'async' for what the Protocol class itself declares."""
    out = {name: "data" for name in getattr(proto, "__annotations__", {})}
    for name, v in vars(proto).items():
        if name.startswith("_") and name not in ("__enter__", "__exit__"):
            continue
        if isinstance(v, property):
            out[name] = "property"
        elif inspect.iscoroutinefunction(v):
            out[name] = "async"
        elif inspect.isfunction(v):
            out[name] = "method"
    return out


def _assigned_in_init(cls) -> set[str]:
    """`self.<name> = ...` targets in the __init__ of cls and its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        names.add(el.attr)
    return names


def _signature_problem(name: str, want: inspect.Signature, got: inspect.Signature) -> str | None:
    """got accepts every call want describes: same positional names in order, defaults kept; extra ones optional."""
    wp = [p for p in want.parameters.values() if p.name != "self"]
    gp = [p for p in got.parameters.values() if p.name != "self"]
    if any(p.kind == p.VAR_POSITIONAL for p in gp) and any(p.kind == p.VAR_KEYWORD for p in gp):
        return None
    for i, p in enumerate(wp):
        if i >= len(gp) or gp[i].name != p.name:
            return f"{name}: parameter {i + 1} should be {p.name!r} (got {got})"
        if p.default is not p.empty and gp[i].default is p.empty:
            return f"{name}: parameter {p.name!r} needs a default (got {got})"
    for q in gp[len(wp):]:
        if q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            return f"{name}: extra parameter {q.name!r} without a default (got {got})"
    return None


def conformance_problems(cls, proto) -> list[str]:
    problems = []
    in_init = _assigned_in_init(cls)
    for name, kind in _members(proto).items():
        attr = inspect.getattr_static(cls, name, None)
        if kind == "data":
            if attr is None and name not in in_init:
                problems.append(f"{name}: neither a class attribute, a property nor set in __init__")
            continue
        if kind == "property":
            if not isinstance(attr, property) and name not in in_init:
                problems.append(f"{name}: should be a property (or an attribute set in __init__)")
            continue
        if attr is None or not callable(attr):
            problems.append(f"{name}: missing method")
            continue
        if kind == "async" and not inspect.iscoroutinefunction(attr):
            problems.append(f"{name}: should be async")
        if kind == "method" and inspect.iscoroutinefunction(attr):
            problems.append(f"{name}: should not be async")
        p = _signature_problem(name, inspect.signature(getattr(proto, name)), inspect.signature(attr))
        if p:
            problems.append(p)
    return problems


@pytest.mark.parametrize("cls", [EnvWorker, RayEnvWorker])
def test_env_worker_classes_satisfy_the_contract(cls):
    assert conformance_problems(cls, EnvWorkerLike) == []


@pytest.mark.parametrize("cls", [WamkitServerWorker, SGLangServerWorker, RayServerWorker])
def test_server_worker_classes_satisfy_the_contract(cls):
    assert conformance_problems(cls, ServerWorkerLike) == []


def test_the_structural_check_catches_a_broken_worker():
    class Broken(EnvWorker):
        async def reset_sync(self, task_id, trial):  # async where the contract is blocking
            return None

        def execute(self, actions, render=False):  # not async, parameter renamed
            return None

        kill = None

    problems = "\n".join(conformance_problems(Broken, EnvWorkerLike))
    assert "reset_sync: should not be async" in problems
    assert "execute: should be async" in problems and "render_every_step" in problems
    assert "kill: missing method" in problems


def test_instances_pass_isinstance(tmp_path):
    w = EnvWorker("metaworld", {"tasks": "reach-v3"}, index=3)    # not started: no process
    assert isinstance(w, EnvWorkerLike) and w.index == 3
    rw = RayEnvWorker("metaworld", {}, 1, pool=None)               # not started: no Ray
    assert isinstance(rw, EnvWorkerLike)
    for s in (WamkitServerWorker("zero", log_path=tmp_path / "a.log"),
              SGLangServerWorker("/models/m", log_path=tmp_path / "b.log")):
        assert isinstance(s, ServerWorkerLike) and not s.running()
    assert not isinstance(object(), EnvWorkerLike) and not isinstance(w, ServerWorkerLike)


# ---- core.lifecycle: one __enter__/__exit__ for every worker, client and writer -----------------------------------

class _Server(StartStopContext):
    def __init__(self, fail: bool = False):
        self.calls: list[str] = []
        self.fail = fail

    def start(self):
        self.calls.append("start")

    def wait_healthy(self):
        self.calls.append("wait")
        if self.fail:
            raise RuntimeError("not healthy")

    def stop(self):
        self.calls.append("stop")


class _Env(StartClosingContext):
    def __init__(self):
        self.calls: list[str] = []

    def start(self):
        self.calls.append("start")

    def close(self):
        self.calls.append("close")


def test_start_stop_context_stops_a_server_that_never_became_healthy():
    with _Server() as s:
        assert s.calls == ["start", "wait"]
    assert s.calls == ["start", "wait", "stop"]
    bad = _Server(fail=True)
    with pytest.raises(RuntimeError, match="not healthy"):
        with bad:
            pytest.fail("entered a server that is not healthy")
    assert bad.calls == ["start", "wait", "stop"]


def test_start_closing_context_closes_on_error():
    with pytest.raises(KeyError):
        with _Env() as e:
            assert e.calls == ["start"]
            raise KeyError("x")
    assert e.calls == ["start", "close"]


def test_the_worker_families_and_clients_share_the_mixins():
    from wamkit.data.writer import LeRobotWriter
    from wamkit.protocol.client import SyncActionClient

    assert issubclass(EnvWorker, StartClosingContext) and issubclass(RayEnvWorker, StartClosingContext)
    for cls in (WamkitServerWorker, SGLangServerWorker, RayServerWorker):
        assert issubclass(cls, StartStopContext)
    for cls in (SyncActionClient, LeRobotWriter):
        assert issubclass(cls, ClosingContext)


def test_sync_client_closes_its_loop_on_exit():
    from wamkit.protocol.client import SyncActionClient

    with SyncActionClient("http://127.0.0.1:9") as c:
        assert c._thread.is_alive()
    assert c._loop.is_closed() and not c._thread.is_alive()


def test_writer_finalizes_on_success_and_discards_on_error(tmp_path):
    from wamkit.data.writer import LeRobotWriter

    feats = {"action": {"dtype": "float32", "shape": [2]}}
    with LeRobotWriter(tmp_path / "ok", fps=10, features=feats) as w:
        w.add_frame({"action": np.zeros(2, np.float32)})
        w.save_episode("t")
    assert (tmp_path / "ok/meta/info.json").exists() and not list((tmp_path / "ok").glob(".wamkit_episode_*"))
    with pytest.raises(ValueError):
        with LeRobotWriter(tmp_path / "bad", fps=10, features=feats) as w:
            w.add_frame({"action": np.zeros(2, np.float32)})
            raise ValueError("recording failed")
    assert not (tmp_path / "bad/meta").exists() and not list((tmp_path / "bad").glob(".wamkit_episode_*"))


def test_ray_server_worker_ensure_healthy_restarts_only_an_unhealthy_server(monkeypatch):
    """The clients' `worker=` calls ensure_healthy() when the server stops answering; the Ray worker has it too
    (checked without Ray: health and restart stubbed)."""
    w = RayServerWorker.__new__(RayServerWorker)
    restarts = []
    monkeypatch.setattr(w, "restart", lambda timeout=None: restarts.append(timeout), raising=False)
    monkeypatch.setattr(w, "healthy", lambda timeout=2.0: True, raising=False)
    assert w.ensure_healthy() is False and restarts == []
    monkeypatch.setattr(w, "healthy", lambda timeout=2.0: False, raising=False)
    assert w.ensure_healthy(5.0) is True and restarts == [5.0]
