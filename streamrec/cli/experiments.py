"""`streamrec experiments report`: how an experiment's variants (or a model) predicted, graded
against the labelled samples that came later."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from streamrec.cli.common import Commands, add_action
from streamrec.plumbing.config import Config

READ_TIMEOUT_S = 600.0  # reading a topic to its end must not take longer than this


def add_parser(commands: Commands) -> None:
    experiments = commands.add("experiments", "grade experiments' predictions against the labels that came later", run)
    actions = experiments.add_subparsers(dest="experiments_command", metavar="ACTION", required=True)
    report = add_action(
        actions, "report", "count, AUC, log loss and calibration of each variant, per minute and in total",
        "Join each labelled sample of topics.samples to the latest prediction for its (user, item) on "
        "topics.predictions made at or before the sample's time, within --window-s, and grade each variant "
        "of experiment NAME (shadow models apart), or with --model only, a model asked outside experiments. "
        "Exit 1 when there is no prediction to grade.")
    report.add_argument("name", nargs="?", metavar="NAME", help="the experiment (serving.experiments)")
    report.add_argument("--model", dest="only_model", metavar="M",
                        help="only the predictions of model M (without NAME: those made outside experiments)")
    report.add_argument("--window-s", type=float, default=300.0,
                        help="a prediction grades the samples up to this long after it (default 300)")
    report.add_argument("--since-s", type=float, default=0.0,
                        help="only samples written in the last S seconds (default 0: all the topic holds)")
    report.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace, cfg: Config) -> int:
    from streamrec.analysis.grading import Track, grade
    from streamrec.analysis.grading_input import read_for_grading

    if args.name is None and args.only_model is None:
        raise ValueError("name an experiment, or a model with --model")
    if args.window_s <= 0 or args.since_s < 0:
        raise ValueError(f"--window-s must be > 0 and --since-s >= 0, got {args.window_s:g} and {args.since_s:g}")
    labels, rows, counts = read_for_grading(cfg.kafka.bootstrap_servers, cfg.topics.samples, cfg.topics.predictions,
                                            cfg.features, args.since_s, args.window_s, cfg.kafka.connect_timeout_s,
                                            READ_TIMEOUT_S)

    def selected(t: Track) -> bool:
        return t.experiment == args.name and (args.only_model is None or t.model == args.only_model)

    report = grade(labels, rows, args.window_s, selected)
    what = (f"experiment {args.name}" + (f", model {args.only_model}" if args.only_model else "") if args.name
            else f"model {args.only_model} outside experiments")
    if args.json:
        print(json.dumps({"experiment": args.name, "model": args.only_model, "read": asdict(counts), **report.to_json()}, indent=2))
    elif report.tracks:
        print(_table(what, report, counts))
    if not report.tracks:
        seen = sorted({t.experiment for t in rows.tracks if t.experiment})
        print(f"streamrec: no predictions of {what} on {cfg.topics.predictions}"
              + (f" in the last {args.since_s:g} s" if args.since_s else "")
              + f" (experiments there: {', '.join(seen) or 'none'}); is serving.prediction_log on?", file=sys.stderr)
        return 1
    return 0


def _table(what: str, report, counts) -> str:
    lines = [f"{what}: {counts.samples:,} labelled samples, {counts.predictions:,} predictions read; "
             f"join window {report.window_s:g} s",
             f"  samples: {report.samples - report.unmatched - report.other:,} graded here, {report.other:,} served by "
             f"other experiments or models, {report.unmatched:,} without a prediction in the window"]
    skipped = counts.rejected_samples + counts.corrupt_predictions
    if skipped:
        reasons = ", ".join(f"{r} ({n:,})" for r, n in sorted(counts.reasons.items(), key=lambda kv: -kv[1])[:5])
        lines.append(f"  skipped: {counts.rejected_samples:,} rejected samples, {counts.corrupt_predictions:,} corrupt "
                     f"predictions: {reasons}")
    header = f"  {'VARIANT':24} {'MODEL':16} {'REQUESTS':>9} {'SAMPLES':>9} {'CLICKS':>7} {'CTR':>7} {'SCORE':>7} " \
             f"{'AUC':>6} {'LOGLOSS':>7} {'CALIB':>6}"
    lines += ["", header]
    for t in report.tracks:
        lines.append(f"  {t.track.name:24} {t.track.model:16} {t.requests:>9,} " + _grade(t.total))
    minutes = [(m, t.track.name, g) for t in report.tracks for m, g in t.minutes]
    if minutes:
        lines += ["", f"  {'MINUTE':16} {'VARIANT':24} {'SAMPLES':>9} {'CLICKS':>7} {'CTR':>7} {'SCORE':>7} "
                      f"{'AUC':>6} {'LOGLOSS':>7} {'CALIB':>6}"]
        for m, name, g in sorted(minutes):
            lines.append(f"  {time.strftime('%Y-%m-%d %H:%M', time.localtime(m / 1000)):16} {name:24} " + _grade(g))
    return "\n".join(lines)


def _grade(g) -> str:
    def num(x: float | None, width: int, fmt: str) -> str:
        return f"{'-' if x is None else format(x, fmt):>{width}}"

    return (f"{g.count:>9,} {g.clicks:>7,} {num(g.ctr, 7, '.4f')} {num(g.mean_score, 7, '.4f')} {num(g.auc, 6, '.4f')} "
            f"{num(g.logloss, 7, '.4f')} {num(g.calibration, 6, '.3f')}")
