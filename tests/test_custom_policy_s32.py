"""A policy of the user's own, `policy=package.module:Class`, through every verb (a probe's findings, session 32):
serve and eval (in process, and through the server an evaluation starts, which must import the class too) refused
it; an exported custom policy could not be loaded by the CLI; what predict returned was not checked by the server
(wrong action dim, NaN as invalid JSON, int64, short chunks), nor the chunk length in process; in-process evaluation
skipped the server's input check, dumped tracebacks, never closed the policy, handed it writable arrays its video
used, and waited minutes for a slow predict after Ctrl-C / SIGTERM; a custom server failing at start was a 60-line
traceback; a run against server.url recorded policy 'zero'; the batcher's metrics undercounted re-run batches.

Each test writes its policy module into tmp_path (nothing registered: the class is named by its import path)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, RunError, UserError
from wamkit.core.types import Observation
from wamkit.envs.base import EnvSpec
from wamkit.eval.config import EvalConfig
from wamkit.eval.inference import InProcessInference, PolicyFailed, PolicyOutputError
from wamkit.eval.plan import make_plan, step_seed
from wamkit.policies import make_policy, register_policy
from wamkit.policies import catalog

ROOT = Path(__file__).resolve().parents[1]
WAMKIT = str(Path(sys.executable).parent / "wamkit")     # the console script, as a user runs it
MW = ["env=metaworld", "env_args.tasks=reach-v3", "trials=1", "image_size=32", "max_steps=16", "progress=false"]

MODULE = '''
import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np

from wamkit.policies.base import ActionSpec, ChunkConfig, InputSpec, Policy, PolicySpec


@dataclass(frozen=True)
class TestConfig(ChunkConfig):
    true_horizon: int = 0      # the chunk length predict returns (0: horizon)
    fault: str = "none"        # none | shape | int | nan | inf | float64 | torch | list | raise | usererror | write
    state_dim: int = 0
    camera: str = "image"
    slow_flag: str = ""        # predict sleeps while this file exists
    fail_init: bool = False


class TestPolicy(Policy):
    name = "custom-test"
    config_class = TestConfig

    def __init__(self, config=None, **kwargs):
        self.config = c = self.make_config(config, **kwargs)
        if c.fail_init:
            raise RuntimeError("my model cannot start")
        self.spec = PolicySpec(name=self.name, input=InputSpec(cameras=(c.camera,), state_dim=c.state_dim),
                               action=ActionSpec(dim=c.action_dim, horizon=c.horizon))
        self.closed = 0

    def predict(self, observations, seeds):
        c = self.config
        while c.slow_flag and os.path.exists(c.slow_flag):
            time.sleep(0.05)
        if c.fault == "raise":
            raise RuntimeError("boom in my predict")
        if c.fault == "usererror":
            from wamkit.core.errors import UserError
            raise UserError("image too dark for my model")
        if c.fault == "write":
            observations[0].images[c.camera][...] = 255
        h = c.true_horizon or c.horizon
        out = np.stack([np.full((h, c.action_dim), 0.01 * (int(s) % 7), np.float32)
                        + 0.001 * np.arange(h, dtype=np.float32)[:, None] for s in seeds])
        if c.fault == "shape":
            return out[..., :-1]
        if c.fault == "int":
            return out.astype(np.int64)
        if c.fault == "nan":
            out[:, 0, 0] = np.nan
        if c.fault == "inf":
            out[:, -1, -1] = np.inf
        if c.fault == "float64":
            return out.astype(np.float64)
        if c.fault == "list":
            return out.tolist()
        if c.fault == "torch":
            import torch
            return torch.from_numpy(out).requires_grad_(True) * 1.0
        return out

    def max_batch_size(self):
        return 8

    def close(self):
        self.closed += 1


class NoSpec(TestPolicy):
    def __init__(self, config=None, **kwargs):
        self.config = self.make_config(config, **kwargs)


class NoPredict(Policy):
    name = "no-predict"
    config_class = TestConfig


class NotAPolicy:
    def predict(self, observations, seeds):
        return None


class Plain(Policy):
    """No config_class: its options are __init__'s keywords."""
    name = "plain"

    def __init__(self, horizon=4, action_dim=7, gain=1.0):
        self.gain = gain
        self.spec = PolicySpec(name=self.name, action=ActionSpec(dim=action_dim, horizon=horizon))

    def predict(self, observations, seeds):
        return np.zeros((len(observations), self.spec.action.horizon, self.spec.action.dim), np.float32)


class Exportable(TestPolicy):
    name = "custom-exp"

    def __init__(self, config=None, action_pipeline=None, **kwargs):
        import torch

        from wamkit.data.transforms import ActionPipeline

        super().__init__(config, **kwargs)
        self.action_pipeline = action_pipeline if isinstance(action_pipeline, ActionPipeline) else ActionPipeline([])
        torch.manual_seed(0)
        self.net = torch.nn.Linear(2, 3)

    @property
    def module(self):
        return self.net

    def export_config(self):
        return dataclasses.asdict(self.config)
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    """tmp_path/custom_s32/pol.py, importable here (sys.path) and, through the server workers, in their children."""
    pkg = tmp_path / "custom_s32"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pol.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m.startswith("custom_s32")]:
        del sys.modules[m]
    return "custom_s32.pol"


def _obs(n=1, cam="image", state=None):
    return [Observation({cam: np.full((8, 8, 3), 7, np.uint8)}, state, "reach") for _ in range(n)]


def _one_line(p: subprocess.CompletedProcess) -> str:
    err = p.stderr.strip().splitlines()
    err = [ln for ln in err if "render_backend" not in ln]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return err[0]


# ---- 1. the documented example, as written -------------------------------------------------------------------------

def _doc_example() -> tuple[str, list[str]]:
    text = (ROOT / "docs" / "models.md").read_text()
    section = text.split("## Bring your own model", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return code, [ln.strip() for ln in bash.splitlines() if ln.strip().startswith(".venv/bin/wamkit")]


def test_the_documented_example_runs_as_written(tmp_path):
    """docs/models.md "Bring your own model": the module goes to mywam/policy.py, each command runs from the
    directory holding mywam/ (no PYTHONPATH, nothing registered): serve answers with its spec; eval in process and
    through the server it starts give the same episodes."""
    code, commands = _doc_example()
    (tmp_path / "mywam").mkdir()
    (tmp_path / "mywam" / "__init__.py").write_text("")
    (tmp_path / "mywam" / "policy.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    serve = [c for c in commands if " serve " in c]
    evals = [c for c in commands if " eval " in c]
    assert len(serve) == 1 and len(evals) == 2 and any("inference=server" in c for c in evals)

    from wamkit.serve.workers import free_port

    port = free_port()
    argv = serve[0].replace(".venv/bin/wamkit", WAMKIT).replace("port=8000", f"port={port}").split()
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                md = httpx.get(f"http://127.0.0.1:{port}/v1/actions/metadata", timeout=2).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        assert md["policy"]["name"] == "my-policy" and md["output"]["action_dim"] == 4
        assert md["input"]["image_keys"] == ["image"] and md["capabilities"]["max_batch_size"] == 32
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    digests = []
    for c in evals:
        p = subprocess.run(c.replace(".venv/bin/wamkit", WAMKIT).split(), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out = tmp_path / re.search(r"out=(\S+)", c).group(1)
        s = json.loads((out / "summary.json").read_text())
        assert s["episodes"] == 1 and s["config"]["policy"] == "mywam.policy:MyPolicy"
        digests.append([json.loads(x)["actions_digest"] for x in (out / "results.jsonl").read_text().splitlines()])
    assert digests[0] == digests[1]


# ---- 2. one resolver, its checks, register_policy ------------------------------------------------------------------

def test_the_resolver_checks_the_class_and_names_each_mistake_in_one_line(mod):
    p = make_policy(f"{mod}:TestPolicy", action_dim=4, horizon=3, device="cpu")   # common keys it lacks: dropped
    assert p.spec.action.dim == 4 and p.predict(_obs(2), [1, 2]).shape == (2, 3, 4)
    plain = make_policy(f"{mod}:Plain", horizon=2, device="cpu", gain=3.0)         # no config_class: __init__ keys
    assert plain.gain == 3.0 and plain.spec.action.horizon == 2
    for target, says in [
            (f"{mod}:Nope", "cannot import 'Nope': module 'custom_s32.pol' has no attribute 'Nope'"),
            ("custom_s32.nomod:X", "cannot import module 'custom_s32.nomod'"),
            (f"{mod}:NotAPolicy", "is not a wamkit policy (it lacks max_batch_size, warmup"),
            (f"{mod}:NoPredict", "does not implement predict"),
            (f"{mod}:dataclass", "is a function, not a class"),
            (f"{mod}:NoSpec", "has no `spec`; its __init__ must set self.spec"),
            ("gpt", "unknown policy 'gpt'; valid choices:")]:
        with pytest.raises(UserError) as e:
            make_policy(target)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"policy_args.gian: not an option of .*valid keys: action_dim, gain, "):
        make_policy(f"{mod}:Plain", gian=1)
    with pytest.raises(ConfigError, match="policy_args.faut: not an option"):
        make_policy(f"{mod}:TestPolicy", faut="x")


def test_register_policy_refuses_a_malformed_target_and_replacing_a_name(mod):
    with pytest.raises(UserError, match="must be 'package.module:Class'"):
        register_policy("s32-x", f"{mod}.TestPolicy")
    with pytest.raises(UserError, match="'zero' is already the built-in policy wamkit.policies.simple:ZeroPolicy"):
        register_policy("zero", f"{mod}:TestPolicy")
    assert catalog.policy_class("zero").__name__ == "ZeroPolicy"
    try:
        register_policy("s32-mine", f"{mod}:TestPolicy")
        register_policy("s32-mine", f"{mod}:TestPolicy")                       # the same again: fine
        with pytest.raises(UserError, match="already the policy"):
            register_policy("s32-mine", f"{mod}:Plain")
        register_policy("s32-mine", f"{mod}:Plain", override=True)
        assert make_policy("s32-mine").spec.name == "plain"
        assert catalog.policy_target("s32-mine") == f"{mod}:Plain"              # what a child process is given
        assert catalog.policy_target("zero") == "zero"
    finally:
        catalog._REGISTRY.pop("s32-mine", None)


def test_train_resolves_through_the_same_resolver(mod):
    from wamkit.train.trainer import build_for_training, build_policy

    assert build_policy(f"{mod}:Plain", {"gain": 2.0}).gain == 2.0
    with pytest.raises(UserError, match="has no `spec`"):
        build_policy(f"{mod}:NoSpec", {})
    with pytest.raises(UserError, match="is not a wamkit policy"):
        build_for_training(f"{mod}:NotAPolicy", {}, "cpu")


def test_the_cli_takes_a_class_path_and_refuses_a_bad_one_in_one_line(tmp_path, mod):
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([WAMKIT, "serve", "policy=custom_s32.pol:Nope", "port=0"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 2 and "has no attribute 'Nope'" in _one_line(p)
    p = subprocess.run([WAMKIT, "eval", *MW, f"policy={mod}:NotAPolicy", f"out={tmp_path / 'x'}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and "is not a wamkit policy" in _one_line(p)


# ---- 3. exports of a custom policy ---------------------------------------------------------------------------------

def test_an_export_names_its_class_and_loads_in_any_process(tmp_path, mod):
    from wamkit.policies.export import save_exported

    try:
        register_policy("s32-exp", f"{mod}:Exportable")          # a registered name lives in this process only ...
        out = save_exported(make_policy("s32-exp", action_dim=4, horizon=3), tmp_path / "export")
    finally:
        catalog._REGISTRY.pop("s32-exp", None)
    manifest = json.loads((out / "wamkit_policy.json").read_text())
    assert manifest["policy"] == f"{mod}:Exportable"              # ... so the manifest names the class
    code = ("from wamkit.policies import make_policy; import numpy as np; from wamkit.core.types import Observation;"
            f"p = make_policy({str(out)!r}, device='cpu', action_dim=4);"
            "print(type(p).__name__, p.predict([Observation({'image': np.zeros((4, 4, 3), np.uint8)}, None, 't')], "
            "[3]).shape)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0 and p.stdout.split() == ["Exportable", "(1,", "3,", "4)"], p.stderr[-2000:]
    old = tmp_path / "old"                                          # an export written before: a registered name
    old.mkdir()
    for f in out.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    (old / "wamkit_policy.json").write_text(json.dumps({**manifest, "policy": "tiny-wam-exp"}))
    with pytest.raises(UserError, match="names policy 'tiny-wam-exp', which is not a built-in policy nor "
                                        "registered in this process: write its class there as"):
        make_policy(str(old))

    def local():
        class Local(__import__(mod, fromlist=["Exportable"]).Exportable):
            pass
        return Local()
    with pytest.raises(UserError, match="cannot be exported: its class is defined in a function"):
        save_exported(local(), tmp_path / "local")


def test_an_override_of_an_exported_architecture_is_refused(tmp_path):
    """docs/models.md said so; `size=small` on a tiny wam-ref export loaded the tiny weights and said small."""
    pol = make_policy("wam-ref", size="tiny", num_inference_steps=1)
    out = pol.save_pretrained(tmp_path / "export")
    with pytest.raises(UserError, match=r"size='small' would change the exported network \(saved: size='tiny'\)"):
        make_policy(str(out), size="small")
    assert make_policy(str(out), num_inference_steps=2, size="tiny").num_inference_steps == 2


# ---- 4. what predict returns: the same rule on the server and in process -------------------------------------------

@pytest.mark.parametrize("fault, says", [
    ("shape", "returned actions of shape [2, 3, 3] for 2 observation(s); its spec says (2, H, 4)"),
    ("int", "returned actions of dtype int64; predict must return float32"),
    ("nan", "non-finite actions (NaN/inf) for 2 of 2"),
    ("inf", "non-finite actions (NaN/inf) for 2 of 2"),
    ("short", "returned chunks of 2 actions; its horizon is 3 (a shorter chunk is refused"),
    ("float64", None), ("list", None), ("torch", None), ("long", None)])
def test_the_server_checks_what_predict_returns_and_keeps_serving(mod, fault, says):
    from starlette.testclient import TestClient

    from wamkit.protocol import build_request
    from wamkit.serve.app import create_app
    from wamkit.serve.config import ServeConfig

    args = {"fault": fault, "action_dim": 4, "horizon": 3}
    if fault in ("short", "long"):
        args = {"true_horizon": 2 if fault == "short" else 5, "action_dim": 4, "horizon": 3}
    pol = make_policy(f"{mod}:TestPolicy", **args)
    body = json.dumps(build_request(_obs(2), [1, 2], {}, binary=False))
    with TestClient(create_app(ServeConfig(warmup=False, log_every_s=0), pol)) as c:
        r = c.post("/v1/actions/generations", content=body, headers={"content-type": "application/json"})
        if says is None:
            assert r.status_code == 200, r.text
            a = np.asarray([d["action"]["values"] for d in r.json()["data"]], np.float32)
            assert a.shape == (2, 3, 4)                                   # long: the first 3 steps
            np.testing.assert_allclose(a, make_policy(f"{mod}:TestPolicy", action_dim=4, horizon=3).predict(
                _obs(2), [1, 2]), rtol=0, atol=1e-6)
        else:
            assert r.status_code == 500 and "policy 'custom-test'" in r.json()["error"]["message"]
            assert says in r.json()["error"]["message"], r.text
            assert r.json()["error"]["type"] == "policy_output_error"     # clients do not retry it (deterministic)
        pol.config = type(pol.config)(action_dim=4, horizon=3)           # fixed: the same server answers
        r = c.post("/v1/actions/generations", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200


@pytest.mark.parametrize("true_horizon, fails", [(6, False), (2, True)])
def test_in_process_and_server_evaluations_agree_on_a_chunk_of_another_length(tmp_path, mod, true_horizon, fails):
    """A chunk longer than the horizon is cut to it in both modes (the same episodes); a shorter one stops both
    with the same line. The server an evaluation starts imports the class from the test's tmp_path (its
    PYTHONPATH comes from where this process imported it)."""
    from wamkit.eval.runner import run_eval

    got = {}
    for mode in ("inprocess", "server"):
        cfg = load_config(EvalConfig, None, [*MW, f"policy={mod}:TestPolicy", "policy_args.horizon=4",
                                             f"policy_args.true_horizon={true_horizon}", f"inference={mode}",
                                             "server.retries=0", "server.retry_s=0", f"out={tmp_path / mode}"])
        if fails:
            with pytest.raises(RunError) as e:
                run_eval(cfg)
            got[mode] = str(e.value)
        else:
            run_eval(cfg)
            got[mode] = [json.loads(x)["actions_digest"] for x in (tmp_path / mode / "results.jsonl").read_text()
                         .splitlines()]
    if fails:
        core = ("policy 'custom-test' returned chunks of 2 actions; its horizon is 4 (a shorter chunk is refused, "
                "a longer one cut to it)")
        assert got["inprocess"] == core and core in got["server"], got
    else:
        assert got["inprocess"] == got["server"] and len(got["inprocess"]) == 1


# ---- 5. in-process evaluation: input check, errors, read-only arrays, close ----------------------------------------

ENV = EnvSpec(env="metaworld", suite="mt", action_dim=4, cameras=("image",), image_size=8, state_dim=39,
              max_steps=20, control_hz=80.0)


def test_in_process_checks_the_env_against_the_policy_before_any_episode(mod):
    for args, says in [({"state_dim": 8}, "reads a 8-D state (spec.input.state_dim) but the env's state is 39-D"),
                       ({"camera": "wrist_image"}, "reads camera(s) ['wrist_image'] that the env does not render")]:
        inf = InProcessInference(make_policy(f"{mod}:TestPolicy", action_dim=4, **args))
        with pytest.raises(UserError, match=re.escape(says)):
            inf.prepare(ENV)
    inf = InProcessInference(make_policy(f"{mod}:TestPolicy", action_dim=4, horizon=4))
    with pytest.raises(UserError, match=r"horizon=8 asks policy 'custom-test' for chunks of 8 actions; it predicts 4"):
        inf.prepare(ENV, horizon=8)
    inf.prepare(ENV, horizon=2)                       # shorter than the policy's: cut to it
    out = asyncio.run(inf.predict(_obs(1), [0]))
    assert out.shape == (1, 2, 4)


@pytest.mark.parametrize("fault, kind, says", [
    ("raise", PolicyFailed, "failed in predict (RuntimeError: boom in my predict at "),
    ("usererror", UserError, "refused its input (UserError: image too dark for my model at ")])
def test_an_exception_in_predict_is_one_line_naming_the_policy_and_the_episode(mod, fault, kind, says):
    inf = InProcessInference(make_policy(f"{mod}:TestPolicy", action_dim=4, fault=fault))
    plan = make_plan("mt", [0, 1], 3)
    inf.prepare(ENV, episodes=plan, seed=5)
    seed = step_seed(5, plan[4], 12)

    async def main():
        await inf.start()
        try:
            await inf.predict(_obs(1), [seed])
        finally:
            await inf.close()
    with pytest.raises(kind) as e:
        asyncio.run(main())
    msg = str(e.value)
    assert says in msg and "pol.py:" in msg and "\n" not in msg, msg
    assert msg.startswith("policy 'custom-test' ") and "on episode mt/1/1 (env step 12)" in msg
    assert msg.endswith("run the same command with resume=true")


def test_predict_gets_read_only_arrays_and_the_policy_is_closed_at_the_end(mod):
    pol = make_policy(f"{mod}:TestPolicy", action_dim=4, fault="write")
    obs = _obs(1)
    inf = InProcessInference(pol)

    async def main():
        await inf.start()
        try:
            with pytest.raises(PolicyFailed, match="assignment destination is read-only"):
                await inf.predict(obs, [0])
        finally:
            await inf.close()
    asyncio.run(main())
    assert (obs[0].images["image"] == 7).all() and obs[0].images["image"].flags.writeable   # the caller's: intact
    assert pol.closed == 1


def test_output_checks_in_process_name_the_policy(mod):
    async def run(**kw):
        inf = InProcessInference(make_policy(f"{mod}:TestPolicy", action_dim=4, horizon=3, **kw))
        inf.prepare(ENV)
        return await inf.predict(_obs(2), [1, 2])
    for kw, says in [({"fault": "int"}, "dtype int64"), ({"fault": "nan"}, "non-finite"),
                     ({"true_horizon": 2}, "returned chunks of 2 actions; its horizon is 3")]:
        with pytest.raises(PolicyOutputError, match=re.escape(says)):
            asyncio.run(run(**kw))
    assert asyncio.run(run(true_horizon=5)).shape == (2, 3, 4)
    assert asyncio.run(run(fault="torch")).dtype == np.float32


# ---- 6. Ctrl-C / SIGTERM during a slow in-process predict ----------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_slow_predict_stops_the_run_at_once_and_it_resumes(tmp_path, mod, sig):
    flag = tmp_path / "slow"
    flag.write_text("")
    argv = [WAMKIT, "eval", *MW, "progress=true", "progress_every_s=0.5", f"policy={mod}:TestPolicy",
            f"policy_args.slow_flag={flag}", f"out={tmp_path / 'out'}"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # SIGINT as a terminal gives it: a shell without job control starts background jobs (a suite run with `&`) with
    # SIGINT ignored, and an ignored signal stays ignored in every child (session 34: this test hung that way)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        deadline = time.monotonic() + 240
        while not any("waiting on policy 'custom-test': predict running for" in ln for ln in lines):
            assert p.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(p.stderr.readline())
        p.send_signal(sig)
        p.wait(60)   # a run that waited for the predict would never end: it blocks while the flag file exists
    finally:
        if p.poll() is None:
            p.kill()
    assert flag.exists()   # the run ended with its predict still blocked (not returned, not waited for)
    assert p.returncode == (143 if sig == signal.SIGTERM else 130)
    flag.unlink()
    r = subprocess.run(argv[:-1] + [f"out={tmp_path / 'out'}", "resume=true", "progress=false"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["episodes"] == 1


# ---- 7. a server that fails at start: one line -------------------------------------------------------------------

def test_a_custom_server_that_dies_at_start_is_one_line(tmp_path, mod):
    from wamkit.serve.workers import ServerStartError, WamkitServerWorker

    with pytest.raises(ServerStartError) as e:
        with WamkitServerWorker(f"{mod}:TestPolicy", {"fail_init": "true"}, log_path=tmp_path / "s.log") as w:
            w.wait_healthy(120)
    assert isinstance(e.value, RunError) and "\n" not in str(e.value)
    assert "exited with code 1 before becoming healthy: RuntimeError: my model cannot start" in str(e.value)
    assert f"(its log: {tmp_path / 's.log'})" in str(e.value)
    p = subprocess.run([WAMKIT, "eval", *MW, f"policy={mod}:TestPolicy", "policy_args.fail_init=true",
                        "inference=server", f"out={tmp_path / 'x'}"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 1 and "RuntimeError: my model cannot start" in _one_line(p)


# ---- 8. server.url without policy=: the served policy is recorded, and held to on a resume -------------------------

def test_a_run_against_server_url_records_the_served_policy_and_resume_holds_to_it(tmp_path, mod):
    from wamkit.eval.runner import run_eval
    from wamkit.serve.workers import WamkitServerWorker

    def cfg(url, *extra):
        return load_config(EvalConfig, None, [*MW, "trials=2", f"server.url={url}", "inference=server",
                                              f"out={tmp_path / 'out'}", *extra])
    with WamkitServerWorker(f"{mod}:TestPolicy", {"action_dim": 4, "horizon": 4}) as a, \
            WamkitServerWorker("zero", {"action_dim": 4}) as b:
        a.wait_healthy(120)
        b.wait_healthy(120)
        s = run_eval(cfg(a.url))
        assert s["config"]["policy"] == "custom-test" and s["served_policy"]["name"] == "custom-test"
        assert json.loads((tmp_path / "out" / "config.json").read_text())["served_policy"]["url"] == a.url
        assert "custom-test" in (tmp_path / "out" / "report.html").read_text()
        results = tmp_path / "out" / "results.jsonl"
        kept = results.read_text().splitlines()[0] + "\n" + '{"key": "torn'   # killed after one episode
        results.write_text(kept)
        with pytest.raises(UserError, match="was evaluated against a server serving 'custom-test'; server.url now "
                                            "serves 'zero'"):
            run_eval(cfg(b.url, "resume=true"))
        assert results.read_text() == kept           # the refused resume rewrote nothing (its torn line included)
        s = run_eval(cfg(a.url, "resume=true"))
        assert s["episodes"] == 2 and s["served_policy"]["name"] == "custom-test"
        s = run_eval(cfg(a.url, "resume=true"))      # nothing left to run: the summary keeps what was served
        assert s["episodes"] == 2 and s["served_policy"]["name"] == "custom-test"


# ---- 9. the batcher's metrics and timing after a failed batch is run again -----------------------------------------

def test_metrics_count_every_batch_predict_ran_and_timing_is_the_answering_batch():
    from wamkit.serve.batcher import DynamicBatcher
    from wamkit.serve.metrics import ServerMetrics

    calls: list[int] = []
    obs = Observation({"image": np.zeros((4, 4, 3), np.uint8)}, None, "t")

    def predict(o, seeds):
        calls.append(len(seeds))
        if 99 in seeds:
            raise ValueError("poison")
        return np.asarray(seeds, np.float32)[:, None, None] * np.ones((1, 2, 3), np.float32)

    async def main():
        m = ServerMetrics()
        b = DynamicBatcher(predict, max_batch_size=8, max_wait_ms=60_000, max_queue=64, metrics=m)
        await b.start()
        # 8 observations of 5 requests: the batch fills and runs at once, fails, and each request runs alone
        reqs = [asyncio.create_task(b.submit([obs] * len(s), s, ["k"] * len(s)))
                for s in ([1], [2, 3], [99], [4], [5, 6, 7])]
        out = await asyncio.gather(*reqs, return_exceptions=True)
        await b.close()
        return m, out

    m, out = asyncio.run(asyncio.wait_for(main(), 60))
    assert calls == [8, 1, 2, 1, 1, 3]                                         # 16 observations in 6 calls
    counts = m.snapshot()["counts"]
    assert counts["batches"] == 6 and counts["observations_computed"] == 16
    assert counts["batches_split_after_error"] == 1 and isinstance(out[2], ValueError)
    for (actions, timing), n in zip([out[i] for i in (0, 1, 3, 4)], (1, 2, 1, 3)):
        assert timing["batch_size"] == n and timing["batches"] == 1 and actions.shape == (n, 2, 3)


def test_the_client_does_not_retry_a_policy_output_error(mod):
    """The same request makes the policy answer the same unusable actions: retrying it 4 times cost seconds and
    logged four failures before the same error. A real server whose policy answers NaN."""
    import asyncio

    import httpx

    from wamkit.protocol.client import ActionClient, ActionClientError
    from wamkit.serve.workers import WamkitServerWorker

    async def go(url):
        c = ActionClient(url, retries=4, backoff=0.01)
        try:
            with pytest.raises(ActionClientError, match="non-finite"):
                await c.predict(_obs(1), [0])
        finally:
            await c.aclose()

    with WamkitServerWorker(f"{mod}:TestPolicy", {"action_dim": 4, "horizon": 3, "fault": "nan"}) as w:
        w.wait_healthy(120)
        asyncio.run(go(w.url))
        m = httpx.get(f"{w.url}/metrics").json()
    assert m["responses_by_status"].get("500") == 1, m["responses_by_status"]    # asked once, not five times
