"""OUT/report.html: one self-contained page for an evaluation output directory.

What it shows: the per-task success table and a bar chart, the recorded episode videos labelled success / failure,
the timeline picture, throughput and utilization, the resolved config and the versions. Self-contained: styles
inline, the chart is inline SVG, the timeline PNG and the videos are data URIs, nothing is fetched from a network.
Videos beyond EMBED_BUDGET_BYTES (all together) are linked relatively from OUT/videos/ instead, with a note, so the
page still works next to its directory."""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any

from wamkit.core.files import write_atomic
from wamkit.core.secrets import redact
from wamkit.eval.metrics import chunk_ms_text

EMBED_BUDGET_BYTES = 32 * 1024 * 1024   # videos embedded in the page, all together; the rest are linked

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2430}
main{max-width:1180px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}
.sub{color:#5b6472;font-size:13px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:10px 14px;min-width:96px}
.card b{display:block;font-size:22px}.card span{color:#5b6472;font-size:12px}
.row{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}
.row>*{flex:1 1 440px}
table{border-collapse:collapse;background:#fff;font-size:13px;width:100%}
th,td{border:1px solid #e1e4e8;padding:5px 8px;text-align:right}th{background:#eef1f4}
td.l,th.l{text-align:left}tfoot td{font-weight:600;background:#f3f5f7}
svg{background:#fff;border:1px solid #e1e4e8;border-radius:6px}
img.timeline{max-width:100%;background:#fff;border:1px solid #e1e4e8;border-radius:6px}
.videos{display:flex;flex-wrap:wrap;gap:14px}
figure{margin:0;background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:8px;width:256px}
figure video{width:256px;height:auto;display:block;background:#000}
figcaption{font-size:12px;margin-top:6px;line-height:1.4}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;color:#fff;font-weight:600;font-size:11px}
.success{background:#2e8b57}.failure{background:#c0392b}
.note{color:#8a5a00;font-size:12px}
pre{background:#fff;border:1px solid #e1e4e8;border-radius:6px;padding:10px;font-size:12px;overflow:auto}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def load_records(out: Path) -> list[dict[str, Any]]:
    """Per-episode records of OUT/results.jsonl (a torn last line is skipped), in plan order."""
    p = out / "results.jsonl"
    recs = []
    for line in (p.read_text().splitlines() if p.exists() else []):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):   # a line another tool wrote is skipped, not an AttributeError
            recs.append(rec)
    return sorted(recs, key=lambda r: r.get("index", 0))


def _cards(s: dict[str, Any]) -> str:
    th, sch = s.get("throughput", {}), s.get("scheduler", {})
    cards = [(f"{s['success_rate']:.0%}", f"success ({s['successes']}/{s['episodes']})"),
             (f"{th.get('episodes_per_hour', 0):.0f}", "episodes / h"),
             (f"{th.get('env_steps_per_s', 0):.1f}", "env steps / s"),
             (f"{th.get('inference_obs_per_s', 0):.1f}", "inference obs / s")]
    if all(isinstance(sch.get(k), (int, float)) for k in ("env_busy", "inference_busy")):
        cards += [(f"{sch['env_busy']:.0%}", "env busy"),
                  (f"{sch['inference_busy']:.0%}", "inference busy"),
                  (f"{sch.get('mean_batch') or 0:.1f}", "mean batch")]
    cards.append((f"{th.get('wall_s', 0):.1f} s", f"wall, {th.get('episodes_this_run', 0)} episodes"))
    return '<div class="cards">' + "".join(f'<div class="card"><b>{_e(v)}</b><span>{_e(k)}</span></div>'
                                           for v, k in cards) + "</div>"


def _table(s: dict[str, Any]) -> str:
    rows = "".join(
        f'<tr data-task-id="{_e(tid)}"><td>{_e(tid)}</td><td class="l">{_e(r.get("task", ""))}</td>'
        f'<td>{r["episodes"]}</td><td>{r["successes"]}</td><td>{r["success_rate"]:.1%}</td>'
        f'<td>{r.get("mean_steps", 0):.0f}</td><td>{chunk_ms_text(r)}</td></tr>'
        for tid, r in s["per_task"].items())
    return ('<table id="tasks"><thead><tr><th>task id</th><th class="l">task</th><th>episodes</th>'
            '<th>successes</th><th>success rate</th><th>mean steps</th><th>chunk ms</th></tr></thead>'
            f"<tbody>{rows}</tbody><tfoot><tr><td>all</td><td class=\"l\"></td><td>{s['episodes']}</td>"
            f"<td>{s['successes']}</td><td>{s['success_rate']:.1%}</td><td></td><td></td></tr></tfoot></table>")


def _bar_chart(s: dict[str, Any]) -> str:
    """Horizontal bars, one per task: success rate with its count."""
    tasks = list(s["per_task"].items())
    label_w, bar_w, row_h, top = 230, 300, 24, 8
    h = top * 2 + row_h * max(len(tasks), 1) + 18
    parts = [f'<svg id="chart" width="{label_w + bar_w + 90}" height="{h}" role="img" '
             f'aria-label="success rate per task">']
    for i, (tid, r) in enumerate(tasks):
        y = top + i * row_h
        name = r.get("task", "") or f"task {tid}"
        short = name if len(name) <= 32 else name[:31] + "…"
        w = bar_w * r["success_rate"]
        parts.append(f'<text x="{label_w - 6}" y="{y + 16}" font-size="12" text-anchor="end">'
                     f'<title>{_e(name)}</title>{_e(tid)}: {_e(short)}</text>'
                     f'<rect x="{label_w}" y="{y + 4}" width="{bar_w}" height="{row_h - 8}" fill="#eef1f4"/>'
                     f'<rect x="{label_w}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="#4c72b0"/>'
                     f'<text x="{label_w + bar_w + 6}" y="{y + 16}" font-size="12">{r["success_rate"]:.0%} '
                     f'({r["successes"]}/{r["episodes"]})</text>')
    ya = top + row_h * len(tasks) + 12
    for frac in (0, 0.5, 1):
        x = label_w + bar_w * frac
        parts.append(f'<text x="{x}" y="{ya}" font-size="10" text-anchor="middle" fill="#5b6472">{frac:.0%}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _throughput(s: dict[str, Any]) -> str:
    th, sch = s.get("throughput", {}), s.get("scheduler", {})
    items = [("episodes this run", th.get("episodes_this_run")), ("wall (s)", _f(th.get("wall_s"), 1)),
             ("episodes / hour", _f(th.get("episodes_per_hour"), 0)),
             ("env steps / s", _f(th.get("env_steps_per_s"), 1)),
             ("inference obs / s", _f(th.get("inference_obs_per_s"), 1))]
    labels = {"mode": "scheduler mode", "num_envs": "env processes", "setup_s": "setup (s, not counted)",
              "env_busy": "env busy (share of env time)", "inference_busy": "inference busy (share of wall time)",
              "requests": "inference requests", "mean_batch": "mean batch", "request_ms_mean": "request (ms, mean)",
              "compute_ms_mean": "server compute (ms, mean)", "env_restarts": "env restarts",
              "env_timeouts": "env timeouts", "server_restarts": "server restarts",
              "request_retries": "requests retried"}
    for k, label in labels.items():
        if k in sch:
            v = sch[k]
            items.append((label, f"{v:.0%}" if k.endswith("_busy") and isinstance(v, (int, float)) else _f(v, 1)))
    return ('<table id="throughput">' + "".join(f'<tr><th class="l">{_e(k)}</th><td>{_e(v)}</td></tr>'
                                                for k, v in items) + "</table>")


def _f(v: Any, nd: int) -> str:
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _videos(out: Path, records: list[dict[str, Any]]) -> str:
    vids = [r for r in records if isinstance(r.get("video"), str) and r["video"]]
    if not vids:
        return '<p class="sub">No episode videos in this run (record the first N episodes with save_videos=N).</p>'
    budget, figs = EMBED_BUDGET_BYTES, []
    for r in vids:
        p = out / r["video"]
        ok = bool(r.get("success"))
        cap = (f'<span class="badge {"success" if ok else "failure"}">{"success" if ok else "failure"}</span> '
               f'{_e(r.get("task", ""))}<br>task {_e(r.get("task_id"))}, trial {_e(r.get("trial"))}, '
               f'{_e(r.get("steps"))} steps')
        inside = (out / "videos").resolve() in p.resolve().parents   # never embed a file from elsewhere (a path in
        if not inside or not p.is_file():                            # results.jsonl could name /etc/passwd)
            why = "is missing" if inside else "is not under videos/ (not embedded)"
            figs.append(f'<figure data-success="{str(ok).lower()}"><figcaption>{cap}<br>'
                        f'<span class="note">video file {_e(r["video"])} {why}</span></figcaption></figure>')
            continue
        size = p.stat().st_size
        if size <= budget:
            budget -= size
            src, note = _data_uri(p, "video/mp4"), ""
        else:
            src = r["video"]
            note = (f'<br><span class="note">not embedded ({size / 1e6:.1f} MB over the page\'s budget): '
                    f'played from {_e(r["video"])} next to this file</span>')
        figs.append(f'<figure data-success="{str(ok).lower()}"><video src="{_e(src)}" controls muted loop '
                    f'playsinline autoplay preload="auto"></video><figcaption>{cap}{note}</figcaption></figure>')
    return '<div class="videos">' + "".join(figs) + "</div>"


def render_html(out: str | Path) -> str:
    """The page for evaluation output directory `out` (needs OUT/summary.json)."""
    from wamkit.eval.metrics import load_summary

    out = Path(out)
    s = load_summary(out)
    cfg, versions = redact(s.get("config", {})), s.get("versions", {})   # (a summary written before redaction too)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime((out / "summary.json").stat().st_mtime))
    title = (f"{cfg.get('env', '?')}/{cfg.get('suite', '?')}: {cfg.get('policy', '?')}, "
             f"{s['successes']}/{s['episodes']} successful")
    png = out / "timeline.png"
    timeline = (f'<img class="timeline" id="timeline" alt="timeline: one lane per env and inference side" '
                f'src="{_data_uri(png, "image/png")}">' if png.exists()
                else '<p class="sub">No timeline.png (no readable timeline.json in this directory).</p>')
    vers = "".join(f'<tr><th class="l">{_e(k)}</th><td class="l">{_e(v)}</td></tr>' for k, v in versions.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>wamkit report: {_e(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><style>{CSS}</style></head>
<body><main>
<h1>{_e(title)}</h1>
<div class="sub">{_e(out)} &middot; {_e(when)} &middot; mode {_e(cfg.get('mode', '?'))}, inference
{_e(cfg.get('inference', '?'))}, {_e(cfg.get('trials', '?'))} trials per task</div>
{_cards(s)}
<h2>Success per task</h2>
<div class="row"><div>{_table(s)}</div><div>{_bar_chart(s)}</div></div>
<h2>Episodes</h2>
{_videos(out, load_records(out))}
<h2>Timeline</h2>
{timeline}
<h2>Throughput and utilization</h2>
<div class="row"><div>{_throughput(s)}</div><div class="sub">Throughput counts this run's episodes over
its evaluation time (a server's start-up is setup, not counted). Env busy: time the env processes spent simulating
or resetting, as a share of their time; inference busy: time the policy was computing, as a share of wall time.
</div></div>
<h2>Configuration</h2>
<pre id="config">{_e(json.dumps(cfg, indent=2))}</pre>
<h2>Versions</h2>
<table id="versions" style="width:auto">{vers}</table>
</main></body></html>
"""


def write_html(out: str | Path) -> Path:
    p = Path(out) / "report.html"
    write_atomic(p, render_html(out))
    return p
