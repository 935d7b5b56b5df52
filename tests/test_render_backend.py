"""render_backend / render_device (wamkit.envs.render_backend): explicit values reach the env process before mujoco
is imported; auto measures once per machine key (cached, re-measured when the key changes), skips and names a
backend that cannot start, and leaves a user's MUJOCO_GL alone; EGL and OSMesa (both Mesa llvmpipe here) give the
same pixels."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from wamkit.core.errors import ConfigError, UserError
from wamkit.envs import render_backend as rb
from wamkit.envs.base import env_class
from wamkit.envs.process_setup import GL_SET_MARK

pytest.importorskip("mujoco")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A private cache dir, no memo from earlier tests, no MUJOCO_GL of the user's (this process's env is restored
    by monkeypatch after the test)."""
    monkeypatch.setenv("WAMKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rb, "_resolved", {})
    monkeypatch.setattr(rb, "_said", set())
    monkeypatch.setattr(rb, "_egl_count", [])
    for v in rb.GL_VARS + (GL_SET_MARK, rb.SAID_MARK):
        monkeypatch.delenv(v, raising=False)
    return tmp_path


MW = env_class("metaworld")


@pytest.fixture
def fake_probe(monkeypatch):
    """probe() replaced by a counter: egl 10 ms/frame, osmesa 20 (or as set in .ms); `.fail` names backends that
    fail to start."""
    class Fake:
        calls: list = []
        ms = {"egl": 10.0, "osmesa": 20.0}
        fail: set = set()

        def __call__(self, backend, device, size, frames=rb.PROBE_FRAMES):
            self.calls.append((backend, device, size))
            if backend in self.fail or (backend, device) in self.fail:
                return {"backend": backend, "device": device, "ok": False, "wall_s": 0.1, "error": "exit code 1"}
            return {"backend": backend, "device": device, "ok": True, "wall_s": 0.1, "startup_s": 0.05,
                    "ms_per_frame": self.ms[backend], "renderer": "fake"}

    f = Fake()
    f.calls = []
    monkeypatch.setattr(rb, "probe", f)
    monkeypatch.setattr(rb, "machine_identity", lambda: {"host": "h", "gpus": [], "driver": "", "mujoco": "3"})
    return f


# ---- bad values ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env", ["metaworld", "libero"])
@pytest.mark.parametrize("kw,key", [({"render_backend": "vulkan"}, "render_backend"),
                                    ({"render_backend": "glfw"}, "render_backend"),
                                    ({"render_device": "gpu1"}, "render_device"),
                                    ({"render_device": -1}, "render_device")])
def test_bad_values_name_the_key(env, kw, key):
    from wamkit.envs.base import env_class

    if env == "libero":
        pytest.importorskip("libero")
    with pytest.raises(ConfigError, match=key):
        env_class(env).make_config(**kw)


def test_good_values_load_from_cli_strings():
    from wamkit.envs.base import env_class

    cfg = env_class("metaworld").make_config(render_backend="osmesa", render_device=2)   # a YAML int -> "2"
    assert (cfg.render_backend, cfg.render_device) == ("osmesa", "2")
    assert env_class("metaworld").make_config().render_backend == "auto"


# ---- explicit values reach the env process -------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, os, sys
    from wamkit.envs.base import env_class
    from wamkit.envs.render_backend import apply_render_options
    apply_render_options(env_class("metaworld"), json.loads(sys.argv[1]))
    import mujoco
    m = mujoco.MjModel.from_xml_string("<mujoco><worldbody><geom size='.1'/></worldbody></mujoco>")
    r = mujoco.Renderer(m, 16, 16)
    print(json.dumps({"ctx": type(r._gl_context).__module__,
                      **{k: os.environ.get(k) for k in ("MUJOCO_GL", "PYOPENGL_PLATFORM", "MUJOCO_EGL_DEVICE_ID")}}))
""")


def _child(kwargs: dict, env: dict) -> dict:
    import os

    penv = {k: v for k, v in os.environ.items() if k not in rb.GL_VARS + (GL_SET_MARK,)}
    penv.update(env)
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], env=penv, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend,other", [("osmesa", "egl"), ("egl", "osmesa")])
def test_explicit_backend_wins_over_the_environment_in_the_child(backend, other):
    got = _child({"render_backend": backend}, {"MUJOCO_GL": other, "PYOPENGL_PLATFORM": other})
    assert got == {"ctx": f"mujoco.{backend}", "MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend,
                   "MUJOCO_EGL_DEVICE_ID": None}


def test_auto_leaves_the_users_mujoco_gl(tmp_path):
    got = _child({"render_backend": "auto"}, {"MUJOCO_GL": "osmesa", "PYOPENGL_PLATFORM": "osmesa",
                                              "WAMKIT_CACHE_DIR": str(tmp_path)})
    assert got["ctx"] == "mujoco.osmesa" and got["MUJOCO_GL"] == "osmesa"
    assert not (tmp_path / rb.RENDER_CACHE).exists()      # nothing was measured


def test_explicit_egl_device_reaches_mujoco():
    # MUJOCO_EGL_DEVICE_ID is read by mujoco.egl when it opens its display: device 0 exists here (llvmpipe)
    got = _child({"render_backend": "egl", "render_device": "0"}, {})
    assert got["ctx"] == "mujoco.egl" and got["MUJOCO_EGL_DEVICE_ID"] == "0"


def test_an_egl_device_this_machine_lacks_is_one_line_before_any_env(monkeypatch):
    """render_device=1 on a machine with one EGL device was a 27-frame traceback from inside every env worker
    (MuJoCo's error); now a ConfigError (exit 2) before any env starts. An EGL that cannot list devices refuses
    nothing."""
    monkeypatch.setattr(rb, "_egl_count", [])
    monkeypatch.setattr(rb, "egl_devices", lambda: [{"index": 0, "cuda": 0, "drm": None, "software": False}])
    with pytest.raises(ConfigError, match=r"render_device=1: this machine has 1 EGL device\(s\) \(indices 0..0"):
        rb.resolve("egl", "1", 64)
    assert rb.resolve("egl", "0", 64).device == 0
    monkeypatch.setattr(rb, "_egl_count", [])
    monkeypatch.setattr(rb, "egl_devices", lambda: [])
    assert rb.resolve("egl", "5", 64).device == 5


@pytest.mark.slow
@pytest.mark.metaworld
def test_env_worker_renders_with_the_configured_backend_and_same_pixels():
    """A real env worker (spawned process): the GL library mapped in it is the configured backend's, whatever
    MUJOCO_GL this process has; EGL and OSMesa frames are identical here (both Mesa llvmpipe, same rasterizer)."""
    pytest.importorskip("metaworld")
    from wamkit.envs.worker import EnvWorker

    frames, libs, said = {}, {}, {}
    for b in ("osmesa", "egl"):
        with EnvWorker("metaworld", dict(tasks=("reach-v3",), image_size=96, max_steps=5, render_backend=b)) as w:
            frames[b] = w.reset_sync(0, 0).images["image"]
            maps = open(f"/proc/{w.pid}/maps").read()
            libs[b] = ("libOSMesa" in maps, "libEGL_mesa" in maps)
            said[b] = w.render["backend"]   # what the worker reports (summary.scheduler.env_render counts these)
    assert libs == {"osmesa": (True, False), "egl": (False, True)}
    assert said == {"osmesa": "osmesa", "egl": "egl"}
    np.testing.assert_array_equal(frames["egl"], frames["osmesa"])


# ---- auto: cache, re-measure, failures -----------------------------------------------------------------------------

def test_auto_measures_once_and_caches(fresh, fake_probe):
    e = rb.choose(224)
    assert e["backend"] == "egl" and e["source"] == "measured"
    assert [c[0] for c in fake_probe.calls] == ["egl", "osmesa"]
    data = json.loads((fresh / rb.RENDER_CACHE).read_text())
    (key, entry), = data["entries"].items()
    assert "224px" in key and " cpu " in key and entry["backend"] == "egl"
    again = rb.choose(224)
    assert len(fake_probe.calls) == 2 and again["source"] == "cached" and again["backend"] == "egl"


def test_auto_remeasures_when_the_key_changes(fresh, fake_probe, monkeypatch):
    rb.choose(224)
    rb.choose(128)                                         # another image size
    assert len(fake_probe.calls) == 4
    fake_probe.ms = {"egl": 30.0, "osmesa": 20.0}
    monkeypatch.setattr(rb, "machine_identity", lambda: {"host": "h", "gpus": ["GPU 0: X (UUID: GPU-1)"],
                                                          "driver": "580.1", "mujoco": "3"})
    e = rb.choose(224)                                     # another GPU/driver identity
    assert len(fake_probe.calls) == 6 and e["backend"] == "osmesa" and e["source"] == "measured"
    assert len(json.loads((fresh / rb.RENDER_CACHE).read_text())["entries"]) == 3


def test_resolve_says_one_line_with_figures(fresh, fake_probe, capsys):
    kw = {"render_backend": "auto", "image_size": 64}
    assert rb.worker_kwargs(MW, kw, 0)["render_backend"] == "egl"
    assert rb.worker_kwargs(MW, kw, 1) == {**kw, "render_backend": "egl", "render_device": "auto"}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "render_backend=auto chose egl at 64px" in err[0]
    assert "10.0 ms/frame" in err[0] and "osmesa 20.0 ms/frame" in err[0]
    assert len(fake_probe.calls) == 2


def test_the_line_is_said_once_not_again_by_each_env_process(fresh, monkeypatch, capsys):
    """The parent prints the choice; env processes it spawns afterwards (they inherit its environment) do not."""
    import subprocess
    import sys

    monkeypatch.setenv("MUJOCO_GL", "egl")
    r = rb.resolve("auto", "auto", 224)
    rb.say(r)
    rb.say(r)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    code = ("from wamkit.envs import render_backend as rb; r = rb.resolve('auto', 'auto', 224); rb.say(r); "
            "import os; os.environ.pop(rb.SAID_MARK); rb._said.clear(); rb.say(r)")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stderr.count("from the environment wins") == 1   # quiet while marked; says it once unmarked


def test_users_mujoco_gl_wins_over_auto_but_wamkits_default_does_not(fresh, fake_probe, monkeypatch):
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    r = rb.resolve("auto", "auto", 224)
    assert r.backend is None and "MUJOCO_GL=osmesa from the environment wins" in r.line
    assert rb.worker_kwargs(MW, {}, 0) == {}      # the env process inherits it unchanged
    assert fake_probe.calls == []
    monkeypatch.setenv(GL_SET_MARK, "osmesa")              # wamkit set it (setup_headless_gl's default): measure
    assert rb.resolve("auto", "auto", 224).backend == "egl" and len(fake_probe.calls) == 2


def test_a_backend_that_fails_is_skipped_and_named(fresh, fake_probe):
    fake_probe.fail = {"egl"}
    e = rb.choose(224)
    assert e["backend"] == "osmesa" and "egl failed (exit code 1)" in e["reason"]
    fake_probe.fail = {"egl", "osmesa"}
    with pytest.raises(UserError, match="no backend could render.*egl failed.*osmesa failed"):
        rb.choose(100)


def test_real_probes_a_crashing_gl_stack_is_skipped(fresh, monkeypatch, tmp_path):
    """Real probe processes: egl's dies (as in a GL driver crash), osmesa's renders; the caller lives on."""
    crash = tmp_path / "probe.py"
    crash.write_text("import os, runpy, signal, sys\n"       # SIGKILL: a death without a core file
                     "if os.environ.get('MUJOCO_GL') == 'egl': os.kill(os.getpid(), signal.SIGKILL)\n"
                     f"sys.argv[0] = {str(rb.PROBE_SCRIPT)!r}\n"
                     f"runpy.run_path({str(rb.PROBE_SCRIPT)!r}, run_name='__main__')\n")
    monkeypatch.setattr(rb, "PROBE_SCRIPT", crash)
    e = rb.choose(32)
    assert e["backend"] == "osmesa" and "egl failed (killed by signal 9)" in e["reason"]
    osm = next(p for p in e["probes"] if p["backend"] == "osmesa")
    assert osm["ok"] and osm["ms_per_frame"] > 0 and "llvmpipe" in osm["renderer"]


def test_real_probes_a_missing_egl_device_is_named(fresh):
    e = rb.choose(32, device=99)             # render_device=99: no such EGL device here, osmesa renders
    assert e["backend"] == "osmesa"
    assert "egl device 99 failed" in e["reason"] and "MUJOCO_EGL_DEVICE_ID" in e["reason"]


# ---- several GPUs (EGL device lists given; the probes are fakes) ---------------------------------------------------

def test_several_gpus_prefer_egl_devices_off_the_models_gpu(fresh, fake_probe, monkeypatch):
    devs = [{"index": 0, "cuda": 0}, {"index": 1, "cuda": 1}, {"index": 2, "cuda": 2},
            {"index": 3, "cuda": None, "software": True}]
    monkeypatch.setattr(rb, "egl_devices", lambda: devs)
    e = rb.measure(224, gpus=3)
    assert (e["backend"], e["device"], e["devices"]) == ("egl", 1, [1, 2])
    assert fake_probe.calls == [("egl", 1, 224)]          # preferred without a race against osmesa
    r = rb.Resolved(e["backend"], e["device"], tuple(e["devices"]))
    assert [r.for_worker(i) for i in range(4)] == [1, 2, 1, 2]
    # the preferred device does not render: named, then EGL on the model's GPU against osmesa
    fake_probe.fail = {("egl", 1)}
    fake_probe.ms = {"egl": 5.0, "osmesa": 20.0}
    e = rb.measure(224, gpus=3)
    assert (e["backend"], e["device"], e["devices"]) == ("egl", 0, [])
    assert "egl device 1 failed" in e["reason"] and "contention" in e["reason"]


def test_workers_spread_over_the_chosen_devices(fresh, monkeypatch):
    monkeypatch.setattr(rb, "choose", lambda size, dev=None: {"backend": "egl", "device": 1, "devices": [1, 2, 3],
                                                              "reason": "r", "source": "cached", "cache": "c"})
    got = [rb.worker_kwargs(MW, {"render_backend": "auto"}, i)["render_device"] for i in range(4)]
    assert got == ["1", "2", "3", "1"]
    # an explicit device is kept for every worker
    monkeypatch.setattr(rb, "egl_devices", lambda: [{"index": i} for i in range(6)])
    assert rb.worker_kwargs(MW, {"render_backend": "egl", "render_device": 5}, 3)["render_device"] == "5"


def test_too_late_in_a_process_that_loaded_mujoco(fresh, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "mujoco", sys.modules.get("mujoco") or types.ModuleType("mujoco"))
    monkeypatch.setenv("MUJOCO_GL", "egl")
    with pytest.raises(ConfigError, match="render_backend=osmesa: mujoco is already loaded"):
        rb.apply(rb.Resolved("osmesa"))
    rb.apply(rb.Resolved("egl"))                          # the same backend is fine


# ---- same pixels ---------------------------------------------------------------------------------------------------

FRAME = textwrap.dedent("""
    import sys, numpy as np
    from wamkit.envs import render_probe
    import mujoco
    m = mujoco.MjModel.from_xml_string(render_probe._scene(224))
    d = mujoco.MjData(m); mujoco.mj_forward(m, d)
    r = mujoco.Renderer(m, 224, 224); r.update_scene(d, camera="c"); np.save(sys.argv[1], r.render())
""")


def test_egl_and_osmesa_render_the_same_pixels(tmp_path):
    """One 224^2 frame of the probe scene (shadows, 4x MSAA) per backend: on this machine both are Mesa llvmpipe,
    and the frames are bit-identical."""
    import os

    out = {}
    for b in rb.BACKENDS:
        env = {k: v for k, v in os.environ.items() if k not in rb.GL_VARS}
        env.update(MUJOCO_GL=b, PYOPENGL_PLATFORM=b)
        p = subprocess.run([sys.executable, "-c", FRAME, str(tmp_path / f"{b}.npy")],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        out[b] = np.load(tmp_path / f"{b}.npy")
    assert out["egl"].shape == (224, 224, 3) and out["egl"].std() > 5     # a real picture, not a blank
    np.testing.assert_array_equal(out["egl"], out["osmesa"])


def test_a_near_tie_keeps_egl_and_says_so(fresh, fake_probe):
    fake_probe.ms = {"egl": 10.4, "osmesa": 10.0}         # within TIE (5%) of the fastest
    e = rb.choose(224)
    assert e["backend"] == "egl" and e["reason"].startswith("within 5% of the fastest: egl 10.4 ms/frame")
    fake_probe.ms = {"egl": 11.0, "osmesa": 10.0}
    e = rb.choose(225)
    assert e["backend"] == "osmesa" and e["reason"].startswith("fastest: osmesa 10.0 ms/frame")


def test_an_env_built_in_a_process_that_loaded_mujoco_refuses_another_backend(monkeypatch):
    pytest.importorskip("metaworld")
    from wamkit.envs.metaworld import MetaWorldEnv

    monkeypatch.setenv("MUJOCO_GL", "egl")
    import mujoco  # noqa: F401 - loaded here, as in any process that built an env before

    with pytest.raises(ConfigError, match="render_backend=osmesa: mujoco is already loaded"):
        MetaWorldEnv(tasks=("reach-v3",), render_backend="osmesa")
    MetaWorldEnv(tasks=("reach-v3",), render_backend="egl").close()


def test_ray_actors_get_the_mark_with_mujoco_gl(monkeypatch):
    """A MUJOCO_GL that wamkit set in the driver travels to Ray actors with its mark: auto there still measures."""
    from wamkit.runtime.ray_session import RayOptions

    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setenv(GL_SET_MARK, "egl")
    env = RayOptions().runtime_env()["env_vars"]
    assert env["MUJOCO_GL"] == "egl" and env[GL_SET_MARK] == "egl"


def test_describe_counts_workers_by_backend_and_device():
    assert rb.describe([{"backend": "egl", "device": None}] * 2 + [{"backend": "egl", "device": 1}, None,
                                                                    {"backend": "osmesa", "device": None}]) == \
        {"egl": 2, "egl device 1": 1, "osmesa": 1}
    assert rb.describe([None, None]) == {}


def test_in_use_reads_what_mujoco_was_imported_with(monkeypatch):
    import mujoco  # noqa: F401  (in_use says None before mujoco is loaded)

    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setenv("MUJOCO_EGL_DEVICE_ID", "2")
    assert rb.in_use() == {"backend": "egl", "device": 2}
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    assert rb.in_use() == {"backend": "osmesa", "device": None}
    monkeypatch.delenv("MUJOCO_GL")
    assert rb.in_use() == {"backend": "glfw", "device": None}
    monkeypatch.delitem(sys.modules, "mujoco")
    assert rb.in_use() is None
    # an env that imports mujoco only when it builds its first scene (LIBERO) still says what it will render with
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    assert rb.in_use(env_class("libero")) == {"backend": "osmesa", "device": None}
