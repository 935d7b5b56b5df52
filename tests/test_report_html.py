"""OUT/report.html in a real headless browser (Debian's chromium driven by playwright) on a real MetaWorld evaluation:
the page loads with no console errors and fetches nothing, one table row per task, the videos play, the timeline
renders. Plus fast checks of the page and of report.md without a browser."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from wamkit.core.config import load_config
from wamkit.eval.config import EvalConfig


def chromium_path() -> str | None:
    """The system chromium (Makefile APT_PKGS); Debian's /usr/bin/chromium is a wrapper around this binary."""
    for p in (os.environ.get("WAMKIT_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if p and Path(p).exists():
            return p
    return None


@pytest.fixture(scope="module")
def mw_out(tmp_path_factory):
    """A real evaluation: the MetaWorld scripted expert, 2 tasks x 1 trial, both episodes recorded; within 60 steps
    reach succeeds and drawer-open does not, so both labels show. 32 px observations (the videos are enlarged)."""
    pytest.importorskip("metaworld")
    from wamkit.eval.runner import run_eval

    out = tmp_path_factory.mktemp("report") / "ev"
    cfg = load_config(EvalConfig, None, ["env=metaworld", "env_args.tasks=reach-v3,drawer-open-v3", "trials=1",
                                         "image_size=32", "policy=metaworld-expert", "horizon=4", "max_steps=60",
                                         "mode=auto", "num_envs=2", "save_videos=2", "progress=false",
                                         f"out={out}"])
    run_eval(cfg)
    return out


@contextlib.contextmanager
def report_page(out: Path, width: int = 1280, height: int = 900):
    """(page, errors, fetched): OUT/report.html open in headless chromium; errors collects console errors and
    uncaught exceptions, fetched every URL requested other than the page itself and data: URIs."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("no chromium on this machine: `make setup` installs Debian's chromium (Makefile APT_PKGS)")
    url = (out / "report.html").resolve().as_uri()
    errors, fetched = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: fetched.append(r.url)
                    if not r.url.startswith(("data:", url)) else None)
            page.goto(url, wait_until="load")
            yield page, errors, fetched
        finally:
            browser.close()


def _browser_check(out: Path) -> dict:
    pytest.importorskip("playwright.sync_api")
    with report_page(out) as (page, errors, fetched):
        rows = page.locator("#tasks tbody tr").count()
        img = page.evaluate("() => { const i = document.getElementById('timeline');"
                            " return i ? [i.complete, i.naturalWidth] : null; }")
        videos = page.evaluate("""async () => Promise.all([...document.querySelectorAll('video')].map(async v => {
            await v.play();
            if (v.readyState < 2) await new Promise(r => v.addEventListener('loadeddata', r, {once: true}));
            return {ready: v.readyState, width: v.videoWidth, error: v.error && v.error.code,
                    success: v.closest('figure').dataset.success,
                    label: v.closest('figure').querySelector('.badge').textContent};
        }))""")
    return {"errors": errors, "fetched": fetched, "rows": rows, "img": img, "videos": videos}


@pytest.mark.slow
@pytest.mark.metaworld
def test_report_html_in_headless_chromium(mw_out):
    summary = json.loads((mw_out / "summary.json").read_text())
    r = _browser_check(mw_out)
    assert r["errors"] == []
    assert r["fetched"] == []                       # self-contained: no network, no sibling files
    assert r["rows"] == len(summary["per_task"]) == 2
    assert r["img"] is not None and r["img"][0] and r["img"][1] > 0
    recs = [json.loads(x) for x in (mw_out / "results.jsonl").read_text().splitlines()]
    assert len(r["videos"]) == sum(1 for x in recs if x.get("video")) == 2
    for v in r["videos"]:
        assert v["ready"] >= 2 and v["error"] is None
        assert v["width"] >= 224                     # 32 px observations, enlarged for a person to judge
        assert v["label"] == ("success" if v["success"] == "true" else "failure")
    # the labels follow the episodes' outcomes
    assert sorted(v["success"] for v in r["videos"]) == sorted(str(x["success"]).lower() for x in recs)
    md = (mw_out / "report.md").read_text()
    assert "](timeline.png)" in md and "Utilization: env busy" in md and "(report.html)" in md


@pytest.mark.slow
@pytest.mark.metaworld
def test_large_videos_are_linked_not_embedded(mw_out, tmp_path, monkeypatch):
    """Over the embedding budget a video is referenced from OUT/videos/ (relative) and still plays."""
    from wamkit.eval import report_html

    out = tmp_path / "copy"
    shutil.copytree(mw_out, out)
    monkeypatch.setattr(report_html, "EMBED_BUDGET_BYTES", 0)
    report_html.write_html(out)
    page = (out / "report.html").read_text()
    assert 'src="videos/' in page and "data:video/mp4" not in page
    r = _browser_check(out)
    assert r["errors"] == [] and len(r["videos"]) == 2
    assert all(v["ready"] >= 2 for v in r["videos"])


def _fake_out(tmp_path: Path) -> Path:
    """An output directory written by hand: summary, two episodes (one with a video), no timeline."""
    from wamkit.eval.metrics import summarize
    from wamkit.eval.video import write_mp4

    recs = [{"key": f"k{i}", "index": i, "suite": "mt", "task_id": i, "task": f"task <{i}>", "trial": 0,
             "success": i == 0, "steps": 10, "env_steps": 10, "wall_s": 1.0} for i in range(2)]
    write_mp4(tmp_path / "videos" / "ep0.mp4", [np.full((32, 48, 3), 9 * k, np.uint8) for k in range(8)])
    recs[0]["video"] = "videos/ep0.mp4"
    s = summarize(recs, wall_s=2.0, config={"env": "metaworld", "suite": "mt", "policy": "p&q"},
                  versions={"wamkit": "0"})
    (tmp_path / "summary.json").write_text(json.dumps(s))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"torn')
    return tmp_path


def test_report_page_without_browser(tmp_path):
    from wamkit.eval.report import write_report

    out = _fake_out(tmp_path)
    write_report(out)
    page = (out / "report.html").read_text()
    assert page.count('<tr data-task-id="') == 2
    assert "task &lt;0&gt;" in page and "p&amp;q" in page      # names are escaped
    assert page.count("<video ") == 1 and "data:video/mp4;base64," in page
    assert 'class="badge success"' in page
    assert "No timeline.png" in page and not (out / "timeline.png").exists()
    assert "http://" not in page and "https://" not in page
    md = (out / "report.md").read_text()
    assert "timeline.png" not in md and "(report.html)" in md


def test_report_embeds_only_files_under_videos_and_reads_odd_records(tmp_path):
    """A probe's findings (session 30): a results.jsonl naming "/etc/passwd" or "../../x" as an episode's video had
    that file embedded in report.html (a page meant to be mailed); lines that are not objects were an
    AttributeError; a | in a task name broke report.md's table."""
    from wamkit.eval.report import write_report

    out = _fake_out(tmp_path / "ev")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()[:2]]
    recs[1]["video"] = str(secret)
    extra = [{**recs[1], "key": "k9", "index": 9, "video": "../secret.txt"}, [1], {"video": 5}]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + extra))
    s = json.loads((out / "summary.json").read_text())
    s["per_task"]["1"]["task"] = "a | b"
    (out / "summary.json").write_text(json.dumps(s))
    write_report(out)
    page = (out / "report.html").read_text()
    import base64

    embedded = [base64.b64decode(m) for m in __import__("re").findall(r"data:video/mp4;base64,([A-Za-z0-9+/=]+)", page)]
    assert len(embedded) == 1 and b"root:x" not in b"".join(embedded)
    assert page.count("is not under videos/ (not embedded)") == 2
    assert "| a \\| b |" in (out / "report.md").read_text()


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.pop("throughput"), "field throughput"),
    (lambda s: s["throughput"].pop("episodes_this_run"), "field throughput.episodes_this_run"),
    (lambda s: s.update(per_task=[1]), "field per_task"),
    (lambda s: s["per_task"]["0"].pop("success_rate"), "field per_task.0.success_rate"),
    (lambda s: s.update(success_rate="50%"), "field success_rate"),
    (lambda s: s.update(scheduler=[]), "field scheduler")])
def test_report_on_a_summary_it_cannot_read_names_the_field(tmp_path, capsys, edit, field):
    """Hand-edited summaries or another tool's: one line naming the field (were KeyError/TypeError tracebacks)."""
    from wamkit.cli.main import main

    out = _fake_out(tmp_path)
    s = json.loads((out / "summary.json").read_text())
    edit(s)
    (out / "summary.json").write_text(json.dumps(s))
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err


def test_report_on_a_run_that_did_not_finish_says_resume(tmp_path, capsys):
    from wamkit.cli.main import main

    out = _fake_out(tmp_path)
    (out / "summary.json").unlink()
    assert main(["report", str(out)]) == 2
    assert "did not finish" in capsys.readouterr().err


def test_report_with_a_null_utilization_falls_back(tmp_path):
    from wamkit.eval.report import write_report

    out = _fake_out(tmp_path)
    s = json.loads((out / "summary.json").read_text())
    s["scheduler"] = {"env_busy": None, "inference_busy": 0.5}
    (out / "summary.json").write_text(json.dumps(s))
    write_report(out)
    assert (out / "report.md").exists()


def test_report_with_a_timeline(tmp_path):
    """timeline.json -> timeline.png, linked from report.md (with the utilization) and embedded in report.html."""
    from wamkit.eval.report import write_report
    from wamkit.eval.timeline import Timeline

    out = _fake_out(tmp_path)
    tl = Timeline(0.0)
    for i in range(2000):                       # two env lanes half busy, one request lane
        tl.add(f"env/{i % 2}", "sim", i * 0.01, i * 0.01 + 0.01)
        tl.add("request", "request", i * 0.01, i * 0.01 + 0.005, n=2)
    tl.save(out / "timeline.json")
    write_report(out)
    from PIL import Image

    assert Image.open(out / "timeline.png").size[0] > 0
    md = (out / "report.md").read_text()
    assert "](timeline.png)" in md and "Utilization: env busy 50% of env time, inference busy 50%" in md
    page = (out / "report.html").read_text()
    assert 'id="timeline"' in page and "data:image/png;base64," in page


def test_report_goes_on_without_a_cut_timeline(tmp_path):
    """A timeline.json cut short (a run killed while an older version wrote it) stopped `wamkit report` with one line:
    the table, report.md and report.html are still wanted; the report says once why there is no timeline."""
    from wamkit.eval.report import print_report
    from wamkit.eval.timeline import Timeline

    out = _fake_out(tmp_path)
    tl = Timeline(0.0)
    tl.add("env/0", "sim", 0.0, 0.5)
    tl.save(out / "timeline.json")
    (out / "timeline.png").write_bytes(b"an older picture")
    os.utime(out / "timeline.png", (1, 1))                 # drawn before the JSON was (re)written and cut
    (out / "timeline.json").write_text((out / "timeline.json").read_text()[:20])
    buf = io.StringIO()
    print_report(out, Console(file=buf, width=200, force_terminal=False))
    text = buf.getvalue()
    warn = [x for x in text.splitlines() if "timeline.json" in x]
    assert len(warn) == 1 and warn[0].startswith("warning: ") and "goes on without it" in warn[0]
    assert "report:" in text and (out / "report.md").exists() and not (out / "timeline.png").exists()
    assert "No timeline.png (no readable timeline.json" in (out / "report.html").read_text()
    assert (out / "timeline.json").read_text().startswith('{"t_origin"')     # the reader moves nothing


def test_videos_are_enlarged_to_be_judged(tmp_path):
    import av

    from wamkit.eval.video import MIN_VIDEO_SIZE, upscale, write_mp4

    small = np.arange(32 * 48 * 3, dtype=np.uint8).reshape(32, 48, 3)
    big = upscale(small)
    assert min(big.shape[:2]) >= MIN_VIDEO_SIZE and big.shape[0] * 48 == big.shape[1] * 32
    k = big.shape[0] // 32
    assert np.array_equal(big[::k, ::k], small)                   # nearest neighbour: the same pixels, bigger
    same = np.zeros((256, 256, 3), np.uint8)
    assert upscale(same) is same
    p = write_mp4(tmp_path / "v.mp4", [small] * 4)
    with av.open(str(p)) as c:
        st = c.streams.video[0]
        assert (st.codec_context.name, st.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert min(st.width, st.height) >= MIN_VIDEO_SIZE


if __name__ == "__main__":
    # the README picture: python tests/test_report_html.py OUT docs/img/report.png [full]
    # a screenshot of OUT/report.html from the top through the timeline (the whole page with "full")
    with report_page(Path(sys.argv[1])) as (page, errors, _):
        page.evaluate("() => Promise.all([...document.querySelectorAll('video')].map(v => "
                      "{ v.controls = false; v.currentTime = v.duration * 0.6; v.pause(); return new Promise(r => "
                      "v.addEventListener('seeked', r, {once: true})); }))")
        if len(sys.argv) > 3 and sys.argv[3] == "full":
            page.screenshot(path=sys.argv[2], full_page=True)
        else:
            bottom = page.evaluate("() => { const b = document.getElementById('timeline').getBoundingClientRect();"
                                   " return b.bottom + window.scrollY + 16; }")
            page.screenshot(path=sys.argv[2], full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": bottom})
        assert not errors, errors
