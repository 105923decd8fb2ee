"""What the trainer tells people: a progress line (in place on a terminal, logged otherwise),
Prometheus metrics on request, and an evaluation log (``eval.jsonl``) for reports.

A row of ``eval.jsonl`` that cannot be written (a full disk) ends the run like any other
write the trainer cannot make (:class:`~streamrec.trainer.local_files.WriteFailed`); the
file keeps only whole rows."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from streamrec.trainer.local_files import JsonLinesFile

log = logging.getLogger("streamrec.trainer")


class TrainerMetrics:
    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples = Counter("streamrec_trainer_samples", "samples trained on", registry=r)
        self.rejected = Gauge("streamrec_trainer_rejected_samples", "samples refused by the checks", ["reason"], registry=r)
        self.loss = Gauge("streamrec_trainer_loss", "training loss of the last batch", registry=r)
        self.auc = Gauge("streamrec_trainer_auc", "progressive-validation AUC over the sliding window", ["scorer"], registry=r)
        self.logloss = Gauge("streamrec_trainer_logloss", "progressive-validation logloss over the sliding window", ["scorer"], registry=r)
        self.lag = Gauge("streamrec_trainer_lag_samples", "samples behind the head of the source", registry=r)
        self.version = Gauge("streamrec_trainer_published_version", "last published model version", registry=r)
        self.trained_through = Gauge("streamrec_trainer_trained_through_ms", "event time trained through", registry=r)
        self.rows = Gauge("streamrec_trainer_table_rows", "rows per sparse table", ["table"], registry=r)
        self.tier_rows = Gauge("streamrec_trainer_tier_rows", "rows each tier of a sparse table holds (gpu_cache, dram, ssd)",
                               ["table", "tier"], registry=r)
        self.announcements_lost = Gauge("streamrec_trainer_announcements_lost",
                                        "version announcements the producer gave up on (nodes still poll the store)", registry=r)
        if port:
            try:
                start_http_server(port, host, registry=r)
            except OSError as exc:
                raise OSError(f"cannot serve the trainer's metrics on {host}:{port} ({exc}): set [trainer] metrics_port "
                              "to a free port, or 0 for none") from None
            log.info("metrics on http://%s:%d/metrics", host, port)

    def observe(self, status: dict[str, Any], table_rows: dict[str, int]) -> None:
        """Set the gauges from a trainer status (``TrainingLoop.status``) and the rows per table."""
        for scorer in ("online", "frozen", "bayes"):
            if f"auc_{scorer}" in status:
                self.auc.labels(scorer).set(status[f"auc_{scorer}"])
                self.logloss.labels(scorer).set(status[f"logloss_{scorer}"])
        if status["lag"] is not None:
            self.lag.set(status["lag"])
        self.trained_through.set(status["trained_through_ms"])
        self.announcements_lost.set(status["announcements_lost"])
        for name, rows in table_rows.items():
            self.rows.labels(name).set(rows)
            for tier, held in status["tiers"][name].items():
                self.tier_rows.labels(name, tier).set(held["rows"])


def _tier_rows(status: dict[str, Any]) -> str:
    """"rows gpu_cache 1,204 dram 880 ssd 0": each tier's rows over every table."""
    totals: dict[str, int] = {}
    for tiers in status.get("tiers", {}).values():
        for tier, held in tiers.items():
            totals[tier] = totals.get(tier, 0) + held["rows"]
    return "rows " + " ".join(f"{tier} {rows:,}" for tier, rows in totals.items()) if totals else ""


def status_line(status: dict[str, Any]) -> str:
    """One status in words: samples, speed, loss, AUCs, lag, version, rows per tier."""
    def number(key: str) -> str:
        v = status.get(key)
        return "-" if v is None else f"{v:.4f}"

    lag = status.get("lag")
    parts = (f"{status['samples']:,} samples", f"{status['samples_per_s']:,.0f}/s", f"loss {number('loss')}",
             f"AUC online {number('auc_online')} frozen {number('auc_frozen')} bayes {number('auc_bayes')}",
             f"lag {'-' if lag is None else f'{lag:,}'}", f"version {status.get('version') or '-'}", _tier_rows(status))
    return "  ".join(part for part in parts if part)


class ProgressReporter:
    """Every ``interval_s``: one status line, rewritten in place on a terminal, logged
    otherwise (a log is read by people too: the JSON is in eval.jsonl); and a row in eval.jsonl."""

    def __init__(self, interval_s: float, eval_log: Path | None, stream=None) -> None:
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.eval_log = JsonLinesFile(eval_log) if eval_log is not None else None
        self._last = time.monotonic()
        self._last_samples = 0

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def report(self, status: dict[str, Any]) -> None:
        now = time.monotonic()
        elapsed = max(1e-9, now - self._last)
        status = {"time": time.time(), **status, "samples_per_s": (status["samples"] - self._last_samples) / elapsed}
        self._last, self._last_samples = now, status["samples"]
        if self.eval_log is not None:
            self.eval_log.append(json.dumps(status).encode() + b"\n")
        if self.tty:
            self.stream.write(f"\r{status_line(status)}   ")
            self.stream.flush()
        else:
            log.info("%s", status_line(status))

    def close(self) -> None:
        if self.eval_log is not None:
            self.eval_log.close()
        if self.tty:
            self.stream.write("\n")
