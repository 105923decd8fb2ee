"""Training/serving skew, measured impression by impression.

:class:`AdServerProbe` plays the ad server: it follows the events topic and, for each
request's impressions as they happen, asks the serving node to score the candidates **by
ids** at the request's time (``ts``), with ``return_features`` so the features the node
used come back. When the Flink job's sample of the same impression arrives, the two are
compared value by value. Each compared impression is also **replayed** by ids at its
``ts`` once the node's feature state is complete past it: that isolates the semantics
(the node's feature code against the job's) from freshness (events not yet in the node's
state when the ad server asked: the watermark's out-of-orderness bound, the watermark
interval and the checkpoint that makes the state visible).

An ad server asks when the impression happens: the probe sends the newest requests first,
over several connections, and skips a request it could only send more than MAX_BEHIND_MS
after its ``ts`` (the generator stamps events with the wall clock), and a replay the node
may no longer keep features for; both are counted by reason, as is a request the node
refuses for that reason. They are the probe's lateness on a busy machine, not the system's
failures.

:func:`feature_skew` turns the records into the figures of the demo's summary and report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict, deque
from functools import partial
from typing import Callable

import numpy as np
import orjson

from streamrec.contracts.events import InvalidEvent, validate_event
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import differing_features
from streamrec.model.metrics import auc
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.serving.errors import BEYOND_HORIZON
from streamrec.serving.features.online_features import REPLAY_HORIZON_MS
from streamrec.demo.probe import BackgroundProbe, ServingClient

log = logging.getLogger("streamrec.demo")
CANDIDATE_FIELDS = ("item_id", "category_id", "advertiser_id", "position")
REPLAY_DELAY_S = 2.0
SAMPLE_WAIT_S = 30.0
CONNECTIONS = 4  # concurrent requests: one at a time, the probe fell minutes behind the topic on 2 cores
MAX_BEHIND_MS = 10_000
# the node keeps features REPLAY_HORIZON_MS before its state, which trails the clock; the
# margin covers the request's way to the node
REPLAY_MAX_BEHIND_MS = REPLAY_HORIZON_MS - 10_000
# why impressions were not asked (the keys of ``AdServerProbe.skipped``)
BEHIND = f"probe behind by more than {MAX_BEHIND_MS // 1000} s"
REPLAY_TOO_OLD = f"replay more than {REPLAY_MAX_BEHIND_MS // 1000} s old"
REFUSED = "refused by the node: ts older than it keeps"
NOT_READY = "before the node first answered"

Job = Callable[[ServingClient], None]


class AdServerProbe(BackgroundProbe):
    def __init__(self, bootstrap: str, events_topic: str, samples_topic: str, clients: list[ServingClient], spec: FeatureSpec,
                 replay_every: int = 2) -> None:
        super().__init__(("adserver-events", self._follow_events), ("adserver-samples", self._follow_samples),
                         *((f"adserver-request-{i}", partial(self._send, c)) for i, c in enumerate(clients)))
        self.bootstrap, self.events_topic, self.samples_topic = bootstrap, events_topic, samples_topic
        self.spec, self.replay_every = spec, replay_every
        self.served: dict[str, dict] = {}  # impression event_id -> {features, score, as_of, ts, version}
        # samples that arrived before their impression was scored: compared when it is,
        # dropped after SAMPLE_WAIT_S
        self.early: dict[str, tuple[float, dict]] = {}
        self.compared: list[dict] = []  # one per impression with both forms
        self._due: deque = deque()  # (monotonic time, entry, sample) of replays
        self._requests: deque[list[dict]] = deque()  # ad requests' impressions not asked yet, in arrival order
        self._replays: deque[tuple[dict, dict]] = deque()  # (entry, sample) of replays due
        self._work = threading.Condition(self._lock)  # for the sending threads, one per client
        self.failed_requests = 0
        self.lag_ms: list[int] = []  # per request asked: how long after its impression's ts
        self.skipped: Counter[str] = Counter()  # impressions not asked (or refused), by reason
        self.answered = False  # the node has answered a predict by ids

    def _send(self, client: ServingClient) -> None:
        while not self._stop.is_set():
            with self._work:
                job = self._next()
                if job is None:
                    self._work.wait(0.2)
                    continue
            job(client)

    def _next(self) -> Job | None:
        """The next request to send (with the lock held): a due replay (one per ``replay_every``
        compared impressions at most), else the newest ad request. An ad server asks when the
        impression happens: a busy probe skips ahead, and drops the requests it left behind once
        they are MAX_BEHIND_MS old."""
        now_ms = time.time() * 1000
        while self._requests and now_ms - self._requests[0][0]["ts"] > MAX_BEHIND_MS:
            self.skipped[BEHIND] += len(self._requests.popleft())
        if self._replays:
            entry, sample = self._replays.popleft()
            return partial(self._replay, entry=entry, sample=sample)
        if self._requests:
            return partial(self._score_request, imps=self._requests.pop())
        return None

    def _skip(self, reason: str, impressions: int) -> None:
        with self._lock:
            self.skipped[reason] += impressions

    def _predict(self, client: ServingClient, body: dict, impressions: int) -> dict | None:
        """The node's answer; None, counted, when it has none: skipped (no model yet at the
        start; a ts older than the node keeps) or failed (anything else)."""
        status, answer = client.call("POST", f"/v1/models/{client.model}:predict", orjson.dumps(body))
        if status == 200:
            self.answered = True
            return answer
        message = str(answer.get("error", {}).get("message", "")) if isinstance(answer, dict) else ""
        if status == 503 and not self.answered:
            self._skip(NOT_READY, impressions)
        elif status == 400 and BEYOND_HORIZON in message:
            self._skip(REFUSED, impressions)
        else:  # a 503 once the node has answered counts as a failure
            with self._lock:
                self.failed_requests += 1
            log.warning("predict by ids failed (%d): %s", status, answer)
        return None

    def _follow_events(self) -> None:
        """Each request's impressions, to be scored by ids when they appear (at their ts)."""
        consumer = make_consumer(self.bootstrap, self.events_topic, group_id=None, auto_offset_reset="latest")
        try:
            while not self._stop.is_set():
                requests: dict[str, list[dict]] = defaultdict(list)
                for records in consumer.poll(100).values():
                    for r in records:
                        try:
                            e = validate_event(r.value)
                        except InvalidEvent:
                            continue  # an ad server never sends what the job rejects: the DLQ's business
                        if e["type"] == "impression":
                            requests[e["request_id"]].append(e)
                with self._work:
                    self._requests.extend(requests.values())
                    self._work.notify(len(requests))
        finally:
            consumer.close()

    def _score_request(self, client: ServingClient, imps: list[dict]) -> None:
        first = imps[0]
        behind_ms = int(time.time() * 1000) - first["ts"]
        if behind_ms > MAX_BEHIND_MS:
            self._skip(BEHIND, len(imps))
            return
        with self._lock:
            self.lag_ms.append(behind_ms)
        body = {"user_id": first["user_id"], "ts": first["ts"], "return_features": True,
                "context": {"device": first["context"]["device"], "local_hour": first["context"]["local_hour"]},
                "candidates": [{"item_id": e["item_id"], "category_id": e["item"]["category_id"],
                                "advertiser_id": e["item"]["advertiser_id"], "position": e["position"]} for e in imps]}
        answer = self._predict(client, body, len(imps))
        if answer is None:
            return
        pairs = []
        with self._lock:
            for e, features, score in zip(imps, answer["features"], answer["scores"]):
                served = {"features": features, "score": score, "as_of": answer["features_as_of"],
                          "version": answer["model_version"], "ts": e["ts"]}
                early = self.early.pop(e["event_id"], None)
                if early is None:
                    self.served[e["event_id"]] = served
                else:
                    pairs.append((served, early[1]))
        for served, sample in pairs:
            self._compare(served, sample)

    def _compare(self, served: dict, sample: dict) -> None:
        """One impression in both forms: record the differences; schedule every
        ``replay_every``-th for a replay a little later (REPLAY_DELAY_S: the node then reads
        the feature state of the same checkpoint)."""
        entry = {"event_id": sample["event_id"], "label": sample["label"], "served": served,
                 "differing": differing_features(self.spec, served["features"], sample)}
        with self._lock:
            self.compared.append(entry)
            replay = len(self.compared) % self.replay_every == 0
        if replay:
            self._due.append((time.monotonic() + REPLAY_DELAY_S, entry, sample))

    def _follow_samples(self) -> None:
        """Samples of scored impressions: compare (a sample ahead of its impression's
        scoring waits for it); queue the replays that are due."""
        consumer = make_consumer(self.bootstrap, self.samples_topic, group_id=None, isolation_level="read_committed",
                                 auto_offset_reset="latest")
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for records in consumer.poll(200).values():
                    for r in records:
                        sample = orjson.loads(r.value)
                        with self._lock:
                            served = self.served.pop(sample["event_id"], None)
                            if served is None:
                                self.early[sample["event_id"]] = (now, sample)
                        if served is not None:
                            self._compare(served, sample)
                with self._lock:  # samples of impressions the probe never scored (before it started, skipped, failed)
                    for event_id in [k for k, (t, _) in self.early.items() if now - t > SAMPLE_WAIT_S]:
                        del self.early[event_id]
                while self._due and self._due[0][0] <= time.monotonic():
                    _, entry, sample = self._due.popleft()
                    with self._work:
                        self._replays.append((entry, sample))
                        self._work.notify()
        finally:
            consumer.close()

    def _replay(self, client: ServingClient, entry: dict, sample: dict) -> None:
        if int(time.time() * 1000) - sample["ts"] > REPLAY_MAX_BEHIND_MS:
            self._skip(REPLAY_TOO_OLD, 1)
            return
        body = {"user_id": sample["user_id"], "ts": sample["ts"], "return_features": True,
                "context": {"device": sample["device"], "local_hour": sample["local_hour"]},
                "candidates": [{k: sample[k] for k in CANDIDATE_FIELDS}]}
        answer = self._predict(client, body, 1)
        if answer is not None:
            entry["replayed"] = {"differing": differing_features(self.spec, answer["features"][0], sample),
                                 "as_of": answer["features_as_of"], "ts": sample["ts"]}

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.compared)

    def report(self) -> dict:
        """How long after the impressions the probe asked, and what it did not ask, by reason (run.json)."""
        with self._lock:
            lag = np.array(self.lag_ms, dtype=np.float64)
            out: dict = {"requests": len(lag), "max_behind_ms": MAX_BEHIND_MS,
                         "skipped_impressions": dict(self.skipped.most_common())}
        if len(lag):
            out["lag_ms"] = {"p50": float(np.percentile(lag, 50)), "p99": float(np.percentile(lag, 99)), "max": float(lag.max())}
        return out


def probe_line(report: dict) -> str:
    """The summary's line on the ad-server probe: its lag and what it skipped."""
    lag = report.get("lag_ms")
    line = f"ad-server probe: {report['requests']:,} ad requests asked by ids"
    if lag:
        line += (f", p50 {lag['p50'] / 1000:.1f} s / p99 {lag['p99'] / 1000:.1f} s / max {lag['max'] / 1000:.1f} s "
                 "after the impression")
    skipped = report["skipped_impressions"]
    return line + "; skipped impressions: " + (", ".join(f"{n:,} {why}" for why, n in skipped.items()) or "none")


def feature_skew(compared: list[dict], spec: FeatureSpec, instance_scores: dict[str, float]) -> dict:
    """Exact-match rates of every feature value, overall and per feature; why values
    differed; AUC of the by-ids scores against the scores of the samples' own features
    (``instance_scores``: event_id -> the probe's score of the sample, same impressions)."""
    names = spec.feature_names()
    n = len(compared)
    out: dict = {"impressions": n, "features": len(names)}
    if not n:
        return out
    diff_count = {name: 0 for name in names}
    reasons = {"in_flight": 0, "unexplained": 0}
    behind = []
    for c in compared:
        as_of, ts = c["served"]["as_of"], c["served"]["ts"]
        behind.append(ts - as_of if as_of is not None else np.nan)
        for name in c["differing"]:
            diff_count[name] += 1
        if c["differing"]:
            # the node's state lacked events in [as_of, ts): those still in flight to it
            reasons["in_flight" if as_of is None or as_of <= ts else "unexplained"] += 1
    values = n * len(names)
    out["identical_pct"] = round(100 * (1 - sum(diff_count.values()) / values), 3)
    out["impressions_all_identical_pct"] = round(100 * sum(1 for c in compared if not c["differing"]) / n, 2)
    out["per_feature_identical_pct"] = {name: round(100 * (1 - diff_count[name] / n), 2) for name in names}
    out["mismatched_impressions_by_reason"] = reasons
    lag = np.array(behind, dtype=np.float64)
    lag = lag[~np.isnan(lag)]
    out["features_behind_request_ms"] = ({"p50": float(np.percentile(lag, 50)), "p99": float(np.percentile(lag, 99))}
                                         if len(lag) else {})
    replays = [c["replayed"] for c in compared if c.get("replayed")]
    complete = [r for r in replays if r["as_of"] is not None and r["as_of"] > r["ts"]]  # the state was complete to ts
    if complete:
        replay_diffs = defaultdict(int)
        for r in complete:
            for name in r["differing"]:
                replay_diffs[name] += 1
        out["replayed"] = {"impressions": len(complete),
                           "identical_pct": round(100 * (1 - sum(replay_diffs.values()) / (len(complete) * len(names))), 3),
                           "per_feature_identical_pct": {name: round(100 * (1 - replay_diffs[name] / len(complete)), 2) for name in names}}
    both = [c for c in compared if c["event_id"] in instance_scores]
    labels = np.array([c["label"] for c in both])
    if len(both) and 0 < labels.sum() < len(both):
        by_ids = np.array([c["served"]["score"] for c in both])
        from_samples = np.array([instance_scores[c["event_id"]] for c in both])
        out["auc"] = {"impressions": len(both), "by_ids": round(float(auc(by_ids, labels)), 4),
                      "sample_features": round(float(auc(from_samples, labels)), 4),
                      "mean_abs_score_diff": round(float(np.abs(by_ids - from_samples).mean()), 5)}
    return out


def skew_line(skew: dict) -> str:
    """The summary's one line (it begins ``feature skew:``)."""
    if not skew.get("impressions"):
        return "feature skew: no impression was scored by ids and matched with its sample"
    r, lag = skew["mismatched_impressions_by_reason"], skew.get("features_behind_request_ms") or {}
    line = (f"feature skew: {skew['identical_pct']:.2f}% of feature values identical to the samples' at request time "
            f"({skew['impressions']:,} impressions by ids; mismatched impressions: {r['in_flight']:,} with events still in "
            f"flight, {r['unexplained']:,} unexplained")
    if lag:
        line += f"; the node's features were p50 {lag['p50'] / 1000:.1f} s / p99 {lag['p99'] / 1000:.1f} s behind the request"
    line += ")"
    if "replayed" in skew:
        line += f"; replayed at the sample's time: {skew['replayed']['identical_pct']:.2f}% ({skew['replayed']['impressions']:,})"
    if "auc" in skew:
        a = skew["auc"]
        line += f"; AUC by ids {a['by_ids']} vs {a['sample_features']} from the samples' features"
    return line
