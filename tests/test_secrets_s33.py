"""Secrets and trust, a security probe's findings (session 33), each against the real thing:
- D2: the eval wrote `server.token` in plain text into config.json, summary.json and report.html (and W&B), as it
  would policy_args.token and a server.url's user:password@; now one redaction (core/secrets.py) everywhere, and a
  resume compares redacted configs;
- M7: the `wamkit serve` processes an evaluation starts for itself had no token (any local user could use them and
  their shared-memory arrays); now a random one per run, in their environment, never their command line, and on
  Ray in the actor's arguments;
- M6: `server.token=` shows in `ps`; now `server.token_file=` (and WAMKIT_TOKEN, which the eval's client ignored);
- M2: loading an export ran code from it (the manifest's module imported from the current directory); a manifest's
  module is now imported only from sys.path as it stands and never from the export's (or checkpoint's) own files;
- M3: a private Ray for runtime=ray listened on the host's address and on wildcard ports (metrics without auth)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

from wamkit.core.config import load_config
from wamkit.core.errors import ConfigError, UserError
from wamkit.core.secrets import REDACTED, redact
from wamkit.core.types import Observation
from wamkit.eval.config import EvalConfig
from processes import descendants, is_loopback, listeners, start_environ

ROOT = Path(__file__).resolve().parents[1]
WAMKIT = str(Path(sys.executable).parent / "wamkit")     # the console script, as a user runs it
ARGS = {"action_dim": 4, "horizon": 2, "base_ms": 0, "per_obs_ms": 0}
EVIL = '''open({marker!r}, "w").write("code ran at import\\n")
class ExportedPolicy: pass
'''


def _obs(n=1):
    return [Observation({"image": np.zeros((8, 8, 3), np.uint8)}, np.zeros(4, np.float32), "reach") for _ in range(n)]


def _cmdlines() -> str:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return "\n".join(out)


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


# ---- D2: nothing written, logged or reported holds a secret ----------------------------------------------------------

def test_redact_hides_secret_keys_at_any_depth_and_url_userinfo():
    cfg = {"server": {"token": "EVALTOKEN_abc123", "token_file": "/run/tok", "url": "http://alice:pw1@h:8000,"
                      "http://h2:8001", "serve_args": {"API_KEY": "k1", "hf_token": "k2", "max_tokens": 5},
                      "sglang": {"extra_args": ["ws://bob:pw2@h3/x"]}},
           "policy_args": {"token": "c3tok", "nested": {"Password": "p", "client_secret": "s"}, "url": "http://h"},
           "tokens": 3, "none_given": {"token": None}}
    out = redact(cfg)
    text = json.dumps(out)
    for secret in ("EVALTOKEN_abc123", "k1", "k2", "pw1", "alice", "pw2", "bob", "c3tok", '"p"', '"s"'):
        assert secret not in text
    assert out["server"]["token"] == out["policy_args"]["token"] == REDACTED
    assert out["server"]["url"] == "http://h:8000,http://h2:8001" and out["server"]["token_file"] == "/run/tok"
    assert out["server"]["serve_args"]["max_tokens"] == 5 and out["tokens"] == 3
    assert out["none_given"] == {"token": None}                     # "no token" stays visible
    assert redact(out) == out and cfg["server"]["token"] == "EVALTOKEN_abc123"   # idempotent, input untouched


@pytest.mark.slow
@pytest.mark.metaworld
def test_an_evaluation_writes_its_token_nowhere(tmp_path):
    """The probe's command, through the CLI: config.json, summary.json, report.html, served_policy, the server's
    log: none holds the token."""
    out = tmp_path / "ev"
    p = subprocess.run([WAMKIT, "eval", "env=metaworld", "env_args.tasks=reach-v3", "trials=1", "image_size=32",
                        "max_steps=8", "policy=metaworld-expert", "horizon=4", "inference=server",
                        "server.token=EVALTOKEN_s33abc", "progress=false", f"out={out}"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert {"config.json", "summary.json", "report.html", "server-0.log"} <= {f.name for f in out.iterdir()}
    assert _files_holding(out, "EVALTOKEN_s33abc") == []
    assert json.loads((out / "config.json").read_text())["server"]["token"] == REDACTED
    assert json.loads((out / "summary.json").read_text())["config"]["server"]["token"] == REDACTED


def test_a_resume_compares_configs_without_their_secrets(tmp_path):
    """A token is not what is evaluated: a resume with another policy_args.token (or against a config.json written
    before redaction, in plain text) continues; a change of what is evaluated is still refused."""
    from wamkit.eval.runner import _check_same_plan, config_record

    def cfg(*extra):
        return load_config(EvalConfig, None, ["policy=zero", f"out={tmp_path}", *extra])

    old = config_record(cfg("policy_args.token=first"))
    assert old["policy_args"]["token"] == REDACTED
    _check_same_plan(cfg("policy_args.token=second"), tmp_path, old)
    plain = json.loads(json.dumps(old))
    plain["policy_args"]["token"] = "first"                         # a config.json from before the redaction
    _check_same_plan(cfg("policy_args.token=second"), tmp_path, plain)
    with pytest.raises(UserError, match="different policy_args"):
        _check_same_plan(cfg("policy_args.token=second", "policy_args.size=tiny"), tmp_path, old)


def test_the_report_and_wandb_get_the_config_redacted(tmp_path, monkeypatch):
    """report.html shows the summary's config (one written before redaction too); W&B gets the run's config."""
    from wamkit.core.tracking import start_wandb
    from wamkit.eval.report_html import render_html

    from wamkit.eval.metrics import summarize

    old = {"env": "metaworld", "server": {"token": "OLDTOKEN_s33", "url": "http://u:OLDPW@h:1"}}
    (tmp_path / "summary.json").write_text(json.dumps(summarize([], wall_s=1.0, config=old, versions={})))
    (tmp_path / "results.jsonl").write_text("")
    page = render_html(tmp_path)
    assert "OLDTOKEN_s33" not in page and "OLDPW" not in page and REDACTED in page
    # wandb is not installed here: a module that records what wandb.init is given stands in for it
    seen = {}
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: seen.update(kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    start_wandb("p", tmp_path / "wb", {"server": {"token": "WBTOKEN_s33"}}, job_type="eval")
    assert seen["config"] == {"server": {"token": REDACTED}}


def test_served_policy_records_a_url_without_its_userinfo(tmp_path):
    """server.url=http://user:password@host: what the run records of the server (served_policy.json, the
    summary's served_policy) keeps the host, not the password."""
    from wamkit.eval.inference import ServerInference
    from wamkit.serve.workers import WamkitServerWorker

    with WamkitServerWorker("fixed-cost", ARGS) as w:
        url = w.url.replace("http://", "http://alice:SECRETPW@")
        cfg = load_config(EvalConfig, None, [f"server.url={url}", "server.protocol=wamkit"])
        inf = ServerInference(policy="fixed-cost", policy_args={}, options=cfg.server, log_dir=tmp_path)

        async def main():
            await inf.start()
            await inf.close()
        asyncio.run(main())
    assert inf.served_policy["url"] == w.url
    assert "SECRETPW" not in (tmp_path / "served_policy.json").read_text()


# ---- M7, M6: the servers an evaluation starts require a token; the user's comes from a file or the environment ----

@pytest.mark.parametrize("protocol", ["auto", "wamkit"])
def test_the_servers_an_evaluation_starts_require_a_token_of_their_own(protocol):
    """No token given: each run's servers get a random one (in their environment, not on their command line), the
    evaluation's client sends it, anyone else is refused (HTTP and the websocket of protocol=auto)."""
    from wamkit.eval.inference import ServerInference

    cfg = load_config(EvalConfig, None, [f"server.protocol={protocol}"])
    tokens = []
    for _ in range(2):
        inf = ServerInference(policy="fixed-cost", policy_args=ARGS, options=cfg.server)

        async def main():
            await inf.start()
            try:
                w = inf.workers[0]
                assert (await inf.predict(_obs(2), [1, 2])).shape == (2, 2, 4)
                r = httpx.get(w.url + "/v1/actions/metadata", timeout=10)
                assert r.status_code == 401
                assert httpx.get(w.url + "/v1/actions/metadata", timeout=10,
                                 headers={"authorization": f"Bearer {w.token}"}).status_code == 200
                pid = w.proc.pid
                assert w.token not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                assert start_environ(pid)[b"WAMKIT_TOKEN"] == w.token.encode()
                tokens.append(w.token)
            finally:
                await inf.close()
        asyncio.run(main())
    assert len(set(tokens)) == 2 and all(len(t) >= 32 for t in tokens)


def test_a_user_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """server.token_file (its first line, stripped) and WAMKIT_TOKEN reach the servers started here and the client; mistakes are
    one line before anything starts."""
    from wamkit.eval.inference import ServerInference

    f = tmp_path / "tok"
    f.write_text("  FILETOKEN_s33\n")
    monkeypatch.delenv("WAMKIT_TOKEN", raising=False)
    for args, want in ((["server.protocol=wamkit", f"server.token_file={f}"], "FILETOKEN_s33"), ([], "ENVTOKEN_s33")):
        if not args:
            monkeypatch.setenv("WAMKIT_TOKEN", "ENVTOKEN_s33")
        cfg = load_config(EvalConfig, None, args)
        inf = ServerInference(policy="fixed-cost", policy_args=ARGS, options=cfg.server)

        async def main():
            await inf.start()
            try:
                assert inf.workers[0].token == want
                assert start_environ(inf.workers[0].proc.pid)[b"WAMKIT_TOKEN"] == want.encode()
                assert (await inf.predict(_obs(), [1])).shape == (1, 2, 4)
            finally:
                await inf.close()
        asyncio.run(main())
    (tmp_path / "empty").write_text(" \n")
    for args, says in (([f"server.token_file={tmp_path / 'none'}"], "server.token_file=.*none"),
                       ([f"server.token_file={tmp_path / 'empty'}"], "server.token_file=.*empty"),
                       ([f"server.token_file={f}", "server.token=x"], "both given"),
                       (["server.serve_args.token=x"], "server.serve_args.token")):
        with pytest.raises(ConfigError, match=says):
            load_config(EvalConfig, None, args)
    p = subprocess.run([WAMKIT, "eval", f"server.token_file={tmp_path / 'none'}"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "server.token_file=" in p.stderr


# ---- M2: an export (or a checkpoint) on disk never runs its own files ------------------------------------------------

def _evil_export(d: Path, marker: Path, module="policy_impl") -> Path:
    d.mkdir(parents=True)
    (d / f"{module}.py").write_text(EVIL.format(marker=str(marker)))
    (d / "wamkit_policy.json").write_text(json.dumps({"format": "wamkit.policy", "version": 1,
                                                      "policy": f"{module}:ExportedPolicy", "config": {},
                                                      "spec": {}, "files": {"weights": "model.safetensors"}}))
    return d


@pytest.mark.parametrize("how", ["console-script", "python -m"])
def test_serving_a_downloaded_export_that_carries_code_does_not_run_it(tmp_path, how):
    """The probe's reproducer, `wamkit serve policy=.` inside the export: one line, exit 2, nothing run (with
    `python -m` the directory is on sys.path by Python's own rule: its files are still not imported)."""
    marker = tmp_path / "PWNED"
    d = _evil_export(tmp_path / "evil_export", marker)
    argv = [WAMKIT] if how == "console-script" else [sys.executable, "-m", "wamkit.cli.main"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([*argv, "serve", "policy=.", "port=0"], cwd=d, capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 2 and not marker.exists(), p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "module 'policy_impl'" in err[0] and "PYTHONPATH" in err[0], p.stderr


def test_the_server_workers_find_a_manifests_module_without_importing_it(tmp_path, monkeypatch):
    """`wamkit eval policy=<export> inference=server` computes its servers' PYTHONPATH from the manifest's module
    (catalog.import_roots): it used to import it, from the current directory too, running it in the eval."""
    from wamkit.policies.catalog import import_roots

    marker = tmp_path / "PWNED"
    d = _evil_export(tmp_path / "exp", marker, module="s33_evil_mod")
    monkeypatch.chdir(d)
    assert import_roots("s33_evil_mod:ExportedPolicy") == [] and not marker.exists()
    monkeypatch.syspath_prepend(str(d))
    assert import_roots("s33_evil_mod:ExportedPolicy") == [str(d.resolve())]
    assert not marker.exists() and "s33_evil_mod" not in sys.modules


def test_exporting_a_checkpoint_that_carries_code_does_not_run_it(tmp_path):
    """`wamkit export CKPT OUT` rebuilds the policy its policy.json names: from a colleague's (or downloaded)
    checkpoint, never a module among its files, even run from inside it with `python -m`."""
    marker = tmp_path / "PWNED"
    step = tmp_path / "run" / "checkpoints" / "step-000010"
    _evil_export(step, marker, module="ckpt_impl")
    (step / "wamkit_policy.json").rename(step / "policy.json")
    (step / "trainer_state.json").write_text("{}")
    p = subprocess.run([sys.executable, "-m", "wamkit.cli.main", "export", ".", str(tmp_path / "out")], cwd=step,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and not marker.exists(), p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "module 'ckpt_impl' would be imported from" in p.stderr


def test_an_export_of_your_own_policy_still_loads_and_names_its_module(tmp_path):
    """Session 32's feature stays: the manifest names `package.module:Class` and any process that imports that
    module (PYTHONPATH) loads the export; the module it imports is named in one logged line."""
    pkg = tmp_path / "src" / "s33pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pol.py").write_text(
        "import numpy as np, torch\n"
        "from wamkit.data.transforms import ActionPipeline\n"
        "from wamkit.policies.simple import ZeroPolicy\n"
        "class Mine(ZeroPolicy):\n"
        "    def __init__(self, action_pipeline=None, **kw):\n"
        "        super().__init__(**kw)\n"
        "        self.action_pipeline = action_pipeline or ActionPipeline([])\n"
        "        self.module = torch.nn.Linear(2, 2)\n"
        "    def export_config(self):\n"
        "        return {'action_dim': self.spec.action.dim, 'horizon': self.spec.action.horizon}\n")
    code = ("import sys; from wamkit.policies import make_policy; from wamkit.policies.export import save_exported;"
            "d = sys.argv[1];"
            "save_exported(make_policy('s33pkg.pol:Mine', action_dim=3, horizon=2), d) if sys.argv[2] == 'save' "
            "else print(type(make_policy(d)).__name__)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    out = tmp_path / "export"
    subprocess.run([sys.executable, "-c", code, str(out), "save"], env=env, check=True, timeout=120, cwd=tmp_path)
    p = subprocess.run([sys.executable, "-c", code, str(out), "load"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=out)
    assert p.returncode == 0 and p.stdout.split() == ["Mine"], p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if "s33pkg.pol" in ln]
    assert len(lines) == 1 and "importing module s33pkg.pol" in lines[0] and str(pkg) in lines[0]


# ---- M3, M7 on Ray: a private Ray on loopback only; a Ray-placed server's token in no argv and no file ------------

RAY_SCRIPT = r'''
import json, sys
import ray
from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig
from wamkit.eval.inference import start_server_workers
from wamkit.runtime.ray_runtime import ray_server_worker_factory
from wamkit.runtime.ray_session import current

cfg = load_config(EvalConfig, None, ["inference=server", "runtime=ray"])
factory = ray_server_worker_factory({"num_gpus_per_server": 0, "num_cpus_per_server": 0, "num_cpus": 2})
[w] = start_server_workers("fixed-cost", json.loads(sys.argv[1]), cfg.server, worker_factory=factory)
ray.get(ray.remote(lambda: 1).options(runtime_env={"env_vars": {"S33": "1"}}).remote())   # the runtime-env agent
print(json.dumps({"url": w.url, "token": getattr(w, "token", None), "temp_dir": current().temp_dir}), flush=True)
sys.stdin.readline()
w.stop()
'''


@pytest.mark.slow
@pytest.mark.ray
def test_a_private_ray_listens_on_loopback_only_and_its_servers_token_stays_secret(tmp_path):
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-c", RAY_SCRIPT, json.dumps(ARGS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        info = json.loads(proc.stdout.readline())
        pids = [proc.pid, *descendants(proc.pid)]
        comms = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids if Path(f"/proc/{pid}").exists()}
        held = listeners(pids)
        assert {comms.get(pid, "") for pid, _, _ in held} >= {"raylet", "gcs_server"}
        assert [(comms.get(pid), addr, port) for pid, addr, port in held if not is_loopback(addr)] == []
        url, token = info["url"], info["token"]
        assert url.startswith("http://127.0.0.1:") and token
        assert httpx.get(url + "/v1/actions/metadata", timeout=10).status_code == 401
        assert httpx.get(url + "/v1/actions/metadata", headers={"authorization": f"Bearer {token}"},
                         timeout=10).status_code == 200
        assert token not in _cmdlines()
        assert _files_holding(Path(info["temp_dir"]), token) == []
    finally:
        try:
            proc.stdin.write("\n")
            proc.stdin.close()
        except BrokenPipeError:   # it ended already (its error is on stderr)
            pass
        proc.wait(120)


def test_review_mends_token_order_non_string_options_and_mapped_loopback(monkeypatch):
    """A review's findings: WAMKIT_TOKEN (exported for wamkit servers) beat cosmos3's own policy_args.token for its
    SGLang server; redaction hid a custom policy's numeric `num_token` (and dropped it from the resume check);
    `::ffff:127.0.0.1` was not a loopback Host."""
    from wamkit.core.secrets import redact
    from wamkit.eval.inference import client_token
    from wamkit.serve.config import is_loopback

    monkeypatch.setenv("WAMKIT_TOKEN", "ENV")
    cfg = load_config(EvalConfig, None, [])
    assert client_token(cfg.server, None, "OWN") == "OWN" and client_token(cfg.server, None) == "ENV"
    cfg = load_config(EvalConfig, None, ["server.token=GIVEN"])
    assert client_token(cfg.server, None, "OWN") == "GIVEN"
    assert redact({"num_token": 8, "use_token": True, "token": "s"}) == {"num_token": 8, "use_token": True,
                                                                        "token": "***"}
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("[::ffff:127.0.0.1]") and is_loopback("ip6-localhost")
    assert not is_loopback("::ffff:10.0.0.1")
