"""The demo's report: ``run.json`` (all figures) and a self-contained ``report.html``
(inline SVG, no scripts, no network) that ``streamrec report RUN_DIR`` re-renders."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

COLORS = {"online": "#1f77b4", "frozen": "#ff7f0e", "bayes": "#2ca02c"}


def write_report(run_dir: Path, result: dict) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = run_dir / "run.json"
    _atomic_write(data, json.dumps(result, indent=2, default=_jsonable))
    return render(run_dir)


def render(run_dir: Path) -> dict:
    """(Re-)render report.html from run.json."""
    run_dir = Path(run_dir)
    data = run_dir / "run.json"
    if not data.is_file():
        raise FileNotFoundError(f"{data} not found: pass a run directory written by `streamrec demo` (var/reports/<run id>)")
    result = json.loads(data.read_text())
    out = run_dir / "report.html"
    _atomic_write(out, _html(result))
    return {"dir": str(run_dir), "data": str(data), "html": str(out)}


def latest_run(reports_dir: Path) -> Path:
    runs = sorted(p for p in Path(reports_dir).glob("*/run.json"))
    if not runs:
        raise FileNotFoundError(f"no demo runs under {reports_dir}: run `streamrec demo` first")
    return runs[-1].parent


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x)}")


def _line_chart(series: list[dict], names: tuple[str, ...], width: int = 720, height: int = 260) -> str:
    points = [(p["t_s"], {n: p.get(n) for n in names}) for p in series]
    values = [v for _, d in points for v in d.values() if v is not None]
    if len(points) < 2 or not values:
        return "<p>Not enough labelled samples for a curve yet (a longer run draws one).</p>"
    x0, x1 = points[0][0], points[-1][0]
    y0, y1 = min(values) - 0.02, max(values) + 0.02
    pad = 40
    sx = lambda x: pad + (x - x0) / max(1e-9, x1 - x0) * (width - 2 * pad)  # noqa: E731
    sy = lambda y: height - pad - (y - y0) / max(1e-9, y1 - y0) * (height - 2 * pad)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f'<rect width="{width}" height="{height}" fill="white" stroke="#ccc"/>']
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#eee"/>'
                     f'<text x="4" y="{sy(y) + 4:.1f}" font-size="11">{y:.3f}</text>')
    parts.append(f'<text x="{width / 2 - 60}" y="{height - 8}" font-size="11">event time since start (s)</text>')
    for name in names:
        pts = " ".join(f"{sx(t):.1f},{sy(d[name]):.1f}" for t, d in points if d[name] is not None)
        parts.append(f'<polyline fill="none" stroke="{COLORS.get(name, "#333")}" stroke-width="2" points="{pts}"/>')
    for i, name in enumerate(names):
        parts.append(f'<rect x="{pad + 10 + i * 110}" y="10" width="12" height="12" fill="{COLORS.get(name, "#333")}"/>'
                     f'<text x="{pad + 26 + i * 110}" y="20" font-size="12">{name}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bars(stages: dict, width: int = 720) -> str:
    rows = [(name, s) for name, s in stages.items() if s.get("n")]
    if not rows:
        return "<p>No click reached a served version during the run.</p>"
    top = max(s["p99"] for _, s in rows) or 1
    h = 28 * len(rows) + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" role="img">']
    for i, (name, s) in enumerate(rows):
        y = 10 + 28 * i
        w99, w50 = max(0, s["p99"]) / top * (width - 330), max(0, s["p50"]) / top * (width - 330)
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(name)}</text>'
                     f'<rect x="170" y="{y}" width="{w99:.1f}" height="18" fill="#c6dbef"/>'
                     f'<rect x="170" y="{y}" width="{w50:.1f}" height="18" fill="#3182bd"/>'
                     f'<text x="{175 + w99:.1f}" y="{y + 14}" font-size="11">p50 {s["p50"] / 1000:.2f} s, p99 {s["p99"] / 1000:.2f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _table(rows: list[tuple], header: tuple) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _html(r: dict) -> str:
    q, f, t, v = r["quality"], r["freshness"], r["throughput"], r["versions"]
    e = f["event_to_servable_ms"]
    late = (q.get("steady") or {}).get("overall", {})
    overall = [(n, m["auc"], m["logloss"], *((late[n]["auc"], late[n]["logloss"]) if n in late else ("", "")))
               for n, m in q["overall"].items()]
    timeline = [(ver, m.get("kind"), m.get("samples_trained"), _clock(m.get("created_at")), _clock(m.get("applied_at")))
                for ver, m in v["timeline"].items()]
    rb = r.get("rollback", {})
    procs = [(n, p["exit"], p["left"]) for n, p in r.get("processes", {}).items()]
    fresh = (f"<p><b>{e['n']}</b> clicks reached a served version: event-to-servable p50 <b>{e['p50'] / 1000:.1f} s</b>, "
             f"p99 <b>{e['p99'] / 1000:.1f} s</b> ({f['not_yet_servable']} not yet servable when the run stopped); "
             f"second half of the run: p50 {f['steady_event_to_servable_ms'].get('p50', 0) / 1000:.1f} s, "
             f"p99 {f['steady_event_to_servable_ms'].get('p99', 0) / 1000:.1f} s.</p>"
             if e.get("n") else "<p>No click reached a served version.</p>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>streamrec demo {html.escape(r['run_id'])}</title>
<style>body{{font-family:sans-serif;max-width:820px;margin:2em auto;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ddd;padding:3px 8px;text-align:right}}th{{background:#f4f4f4}}</style></head><body>
<h1>streamrec demo, run {html.escape(r['run_id'])}</h1>
<p>{r['duration_s']:g} s of live traffic at ~{r['rate']:g} events/s; the trainer published every {r['publish_interval_s']:g} s;
the serving node hot-swapped each version while every sample was scored through its HTTP API.</p>
<h2>Does online learning pay?</h2>
<p>Serving-side AUC over a sliding 30 s window of event time, on the same samples: the hot-swapped <b>online</b> model,
the same model <b>frozen</b> after warm-up (the first version trained on the warm-up samples), and the generator's <b>Bayes</b>-optimal click probability.</p>
{_line_chart(q['series'], ('online', 'frozen', 'bayes'))}
{_table(overall, ('scorer', 'AUC', 'logloss', 'AUC, 2nd half', 'logloss, 2nd half'))}
<p>{q['samples']:,} samples scored ({q['positives']:,} clicks); Bayes known for {q['with_bayes']:,};
{q['left_out_trained_on']:,} left out because the answering version had already trained on them.</p>
{_experiment(q.get('experiment'))}
<h2>Freshness: click event time → prediction served by a version that learned it</h2>
{fresh}
{_bars(f['stages_ms'])}
<p>Dark: p50, light: p99. <i>sample_to_trained</i> includes waiting for the next publish tick.</p>
<h2>Training/serving skew: features by ids against the job's samples</h2>
{_skew(r.get('feature_skew') or {})}
{_ad_server(r.get('ad_server_probe'))}
<h2>Throughput</h2>
{_table([(k, _value(val)) for k, val in t.items()], ('what', 'value'))}
<h2>Resources</h2>
<p>CPU used by each process (with its children: the pipeline includes the Flink JVM) while the traffic ran, and its peak
resident memory. Everything shares the machine's cores.</p>
{_table([(n, x['cpu_s'], x['avg_cores'], f"{x['peak_rss_mb']:,}") for n, x in r.get('resources', {}).items()],
        ('process', 'CPU seconds', 'average cores', 'peak RSS (MB)'))}
<h2>Versions</h2>
<p>{v['published']} published, {v['applied']} applied by the serving node. Rollback:
{'v%s → v%s in %s ms over HTTP, pinned, then released by :reload' % (rb.get('from_version'), rb.get('to_version'), rb.get('http_ms')) if rb.get('done') else 'not exercised'}
{'' if not rb.get('done') else '(ok)' if rb.get('ok') else '(FAILED)'}.</p>
{_table(timeline, ('version', 'kind', 'samples trained', 'published', 'applied'))}
<h2>Processes</h2>
{_table(procs, ('process', 'exit status', 'processes left'))}
</body></html>"""


def _experiment(e: dict | None) -> str:
    """The live experiment's variants as graded from the prediction log (runs before it had none)."""
    if not e:
        return ""
    if "error" in e:
        return f"<h3>Live experiment {html.escape(e['name'])}</h3><p>{html.escape(e['error'])}</p>"
    g, answered = e["graded"], e.get("answered") or {}
    rows = [(name, v["model"], f"{v['count']:,}", v["clicks"], v["auc"], v["logloss"], v["calibration"],
             (answered.get(name) or {}).get("auc")) for name, v in g["variants"].items()]
    return (f"<h3>Live experiment {html.escape(e['name'])}: the same comparison, 50/50 by user</h3>"
            "<p>Each sample was also sent through the node's experiment route: a user's variant answers, the node logs "
            "the answer, and each variant is graded by joining the log with the labelled samples (as "
            "<code>streamrec experiments report</code> does). Each variant scores only its users' samples; beside it, the "
            "AUC of the same answers as the probe received them, which the log's grade must reproduce.</p>"
            + _table(rows, ("variant", "model", "samples graded", "clicks", "AUC", "logloss", "calibration",
                            "AUC, answers as received"))
            + f"<p>{g['unmatched']:,} samples had no logged prediction in the {g['window_s']:g} s window; "
              f"{g['other']:,} were last served outside the experiment; {g.get('left_out_trained_on', 0):,} were left "
              "out because the version that answered had already trained on them (the probe sends samples after they "
              "are written; a live request comes before its sample).</p>")


def _skew(k: dict) -> str:
    if not k.get("impressions"):
        return "<p>No impression was scored by ids and matched with its sample.</p>"
    replayed = k.get("replayed") or {}
    rows = [(name, pct, (replayed.get("per_feature_identical_pct") or {}).get(name, "")) for name, pct in k["per_feature_identical_pct"].items()]
    r, lag, a = k["mismatched_impressions_by_reason"], k.get("features_behind_request_ms") or {}, k.get("auc") or {}
    return (f"<p>An ad-server probe scored each request's impressions <b>by ids</b> when they happened; the serving node "
            f"assembled the features from its online features. Compared with the Flink job's sample of the same "
            f"impression: <b>{k['identical_pct']}%</b> of feature values identical over {k['impressions']:,} impressions "
            f"({k['impressions_all_identical_pct']}% of impressions identical in every feature). Mismatched impressions: "
            f"{r['in_flight']:,} whose request came before the node's state was complete to its time (events still in flight: "
            f"out-of-orderness bound, watermark interval, checkpoint), {r['unexplained']:,} unexplained. "
            + (f"The node's features were p50 {lag['p50'] / 1000:.1f} s, p99 {lag['p99'] / 1000:.1f} s behind the request. " if lag else "")
            + (f"Replayed by ids at the sample's time once the state was complete: <b>{replayed['identical_pct']}%</b> identical "
               f"({replayed['impressions']:,} impressions). " if replayed else "")
            + (f"AUC of the scores by ids {a['by_ids']} vs {a['sample_features']} with the samples' features "
               f"({a['impressions']:,} impressions; mean |score difference| {a['mean_abs_score_diff']})." if a else "")
            + "</p>" + _table(rows, ("feature", "% identical at request time", "% identical replayed")))


def _ad_server(p: dict | None) -> str:
    """How long after the impressions the ad-server probe asked, and what it skipped (runs before it had none)."""
    if not p:
        return ""
    lag = p.get("lag_ms")
    skipped = p["skipped_impressions"]
    return (f"<p>The ad-server probe asked {p['requests']:,} ad requests by ids"
            + (f", p50 {lag['p50'] / 1000:.1f} s, p99 {lag['p99'] / 1000:.1f} s, max {lag['max'] / 1000:.1f} s after "
               "the impression's time" if lag else "")
            + f". An impression it could only ask about more than {p['max_behind_ms'] / 1000:g} s late, a replay older than "
              "the node keeps features for, and a request the node refused for that reason are skipped, not failed: "
            + (", ".join(f"{n:,} {html.escape(why)}" for why, n in skipped.items()) or "none was") + ".</p>")


def _value(val) -> str:
    if isinstance(val, dict):
        return ", ".join(f"{k} {v:,}" for k, v in val.items()) or "-"
    return f"{val:,}" if isinstance(val, int) else str(val)


def _clock(epoch_s) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(epoch_s)) + f".{int(epoch_s * 10) % 10}" if epoch_s else "-"
