"""`/metrics` in the Prometheus text format next to the JSON one, and `device=auto` (GPU when present) for serve and
eval: in-process app (Starlette's TestClient), no subprocess."""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from wamkit.core.device import resolve_device
from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.protocol import build_request
from wamkit.serve.app import create_app
from wamkit.serve.config import ServeConfig

GEN = "/v1/actions/generations"


@pytest.fixture()
def client():
    cfg = ServeConfig(policy="fixed-cost", policy_args={"base_ms": 1, "per_obs_ms": 0, "horizon": 4},
                      warmup=False, log_every_s=0, max_wait_ms=1)
    with TestClient(create_app(cfg)) as c:
        obs = [Observation({"image": np.zeros((8, 8, 3), np.uint8)}, None, "t") for _ in range(3)]
        body = build_request(obs, [1, 2, 3], {}, binary=False)
        r = c.post(GEN, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        yield c


def _families(text: str) -> dict:
    parser = pytest.importorskip("prometheus_client.parser")
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def test_prometheus_text_parses_and_agrees_with_json(client):
    j = client.get("/metrics").json()                                   # default (curl, httpx): JSON as before
    r = client.get("/metrics/prometheus")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = _families(r.text)
    obs = [s.value for s in fams["wamkit_observations_computed"].samples if s.name.endswith("_total")]
    assert obs == [j["counts"]["observations_computed"]] == [3]
    hist = {s.labels.get("le"): s.value for s in fams["wamkit_batch_size"].samples if s.name.endswith("_bucket")}
    assert hist["+Inf"] == sum(j["batch_size_histogram"].values())
    assert hist["2"] <= hist["4"] <= hist["+Inf"]                        # cumulative buckets
    assert fams["wamkit_batch_compute_seconds"].type == "summary"
    status = {s.labels["status"]: s.value for s in fams["wamkit_responses"].samples}
    assert status.get("200") == 1
    assert [s.value for s in fams["wamkit_max_batch_size"].samples] == [j["max_batch_size"]]


@pytest.mark.parametrize("accept,prom", [
    ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True),  # Prometheus
    ("text/plain", True), ("*/*", False), ("application/json", False), ("text/html,application/json", False)])
def test_metrics_content_negotiation(client, accept, prom):
    r = client.get("/metrics", headers={"accept": accept})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain") is prom
    if not prom:
        assert "counts" in r.json()


def test_device_auto_resolves_to_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match="device=cuda"):
        resolve_device("cuda")


def test_serve_and_eval_pass_the_resolved_device_to_the_policy(monkeypatch, tmp_path):
    seen = []

    from wamkit.policies import registry

    real = registry.make_policy

    def spy(name, **kw):
        seen.append(kw.get("device"))
        return real(name, **kw)

    monkeypatch.setattr("wamkit.policies.make_policy", spy)
    monkeypatch.setattr("wamkit.core.device.cuda_available", lambda: True)   # as on a GPU machine
    create_app(ServeConfig(policy="zero", warmup=False, log_every_s=0))
    create_app(ServeConfig(policy="zero", warmup=False, log_every_s=0, policy_args={"device": "cpu"}))
    assert seen == ["cuda", "cpu"]                                   # policy_args.device wins over device=auto


def test_eval_device_goes_to_the_inprocess_policy_and_to_servers(monkeypatch):
    from wamkit.core.config import load_config
    from wamkit.eval import runner
    from wamkit.eval.config import EvalConfig

    seen = []
    monkeypatch.setattr(runner, "make_policy", lambda name, **kw: seen.append(kw.get("device")))
    monkeypatch.setattr("wamkit.core.device.cuda_available", lambda: True)   # as on a GPU machine
    runner.inprocess_policy(load_config(EvalConfig, None, []), {})
    runner.inprocess_policy(load_config(EvalConfig, None, ["device=cpu"]), {})
    runner.inprocess_policy(load_config(EvalConfig, None, []), {"device": "cpu"})
    assert seen == ["cuda", "cpu", "cpu"]
    assert "device" not in runner.server_options(load_config(EvalConfig, None, [])).serve_args   # server decides
    assert runner.server_options(load_config(EvalConfig, None, ["device=cpu"])).serve_args == {"device": "cpu"}


def test_servers_an_eval_launches_batch_at_most_its_envs_observations():
    """An env sends its next observation only once its last one is answered, so a server the eval launches never
    gets more than env_count() at once: its max_batch_size is capped there (wam-ref's warm-up then captures CUDA
    graphs of those batches only), never raised above the configured one."""
    from wamkit.core.config import load_config
    from wamkit.eval import runner
    from wamkit.eval.config import EvalConfig

    def cap(*args):
        return runner.server_options(load_config(EvalConfig, None, list(args))).max_batch_size

    assert cap("num_envs=8", "mode=auto") == 8
    assert cap("num_envs=8", "mode=serial") == 1                     # serial runs one env
    assert cap("num_envs=100", "mode=pipelines") == 64               # the configured cap still holds
    assert cap("num_envs=16", "mode=auto", "server.max_batch_size=4") == 4
    cfg = load_config(EvalConfig, None, ["num_envs=8", "mode=serial"])
    assert cfg.server_batch_cap(cfg.num_envs) == 8 and cfg.server.max_batch_size == 64   # the config is unchanged
