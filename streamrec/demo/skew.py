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

:func:`feature_skew` turns the records into the figures of the demo's summary and report.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque

import numpy as np
import orjson

from streamrec.contracts.events import InvalidEvent, validate_event
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.feature_state import differing_features
from streamrec.model.metrics import auc
from streamrec.plumbing.bus.clients import make_consumer, poll_records
from streamrec.demo.probe import BackgroundProbe, ServingClient

log = logging.getLogger("streamrec.demo")
CANDIDATE_FIELDS = ("item_id", "category_id", "advertiser_id", "position")
REPLAY_DELAY_S = 2.0
SAMPLE_WAIT_S = 30.0


class AdServerProbe(BackgroundProbe):
    def __init__(self, bootstrap: str, events_topic: str, samples_topic: str, client: ServingClient, spec: FeatureSpec,
                 replay_every: int = 2) -> None:
        self.bootstrap, self.events_topic, self.samples_topic = bootstrap, events_topic, samples_topic
        self.client, self.spec, self.replay_every = client, spec, replay_every
        self.served: dict[str, dict] = {}  # impression event_id -> {features, score, as_of, ts, version}
        # samples that arrived before their impression was scored (the probe lags behind the
        # events topic on a busy machine): compared when it is, dropped after SAMPLE_WAIT_S
        self.early: dict[str, tuple[float, dict]] = {}
        self.compared: list[dict] = []  # one per impression with both forms
        self._due: deque = deque()  # (monotonic time, entry, sample) of replays
        self.failed_requests = 0
        self.answered = False  # the node has answered a predict by ids
        super().__init__(("adserver-events", self._follow_events), ("adserver-samples", self._follow_samples))

    def _predict(self, body: dict) -> dict | None:
        status, answer = self.client.call("POST", f"/v1/models/{self.client.model}:predict", orjson.dumps(body))
        if status == 503 and not self.answered:
            return None  # no model yet: expected at the start only
        if status != 200:  # a 503 once the node has answered counts as a failure
            self.failed_requests += 1
            log.warning("predict by ids failed (%d): %s", status, answer)
            return None
        self.answered = True
        return answer

    def _follow_events(self) -> None:
        """Each request's impressions, scored by ids when they appear (at their ts)."""
        consumer = make_consumer(self.bootstrap, self.events_topic, group_id=None, auto_offset_reset="latest")
        try:
            while not self._stop.is_set():
                requests: dict[str, list[dict]] = defaultdict(list)
                for records in poll_records(consumer, 100).values():
                    for r in records:
                        try:
                            e = validate_event(r.value)
                        except InvalidEvent:
                            continue  # an ad server never sends what the job rejects: the DLQ's business
                        if e["type"] == "impression":
                            requests[e["request_id"]].append(e)
                for imps in requests.values():
                    self._score_request(imps)
        finally:
            consumer.close()

    def _score_request(self, imps: list[dict]) -> None:
        first = imps[0]
        body = {"user_id": first["user_id"], "ts": first["ts"], "return_features": True,
                "context": {"device": first["context"]["device"], "local_hour": first["context"]["local_hour"]},
                "candidates": [{"item_id": e["item_id"], "category_id": e["item"]["category_id"],
                                "advertiser_id": e["item"]["advertiser_id"], "position": e["position"]} for e in imps]}
        answer = self._predict(body)
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
        scoring waits for it); run the replays that are due."""
        consumer = make_consumer(self.bootstrap, self.samples_topic, group_id=None, isolation_level="read_committed",
                                 auto_offset_reset="latest")
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for records in poll_records(consumer, 200).values():
                    for r in records:
                        sample = orjson.loads(r.value)
                        with self._lock:
                            served = self.served.pop(sample["event_id"], None)
                            if served is None:
                                self.early[sample["event_id"]] = (now, sample)
                        if served is not None:
                            self._compare(served, sample)
                with self._lock:  # samples of impressions the probe never scored (before it started, a failed call)
                    for event_id in [k for k, (t, _) in self.early.items() if now - t > SAMPLE_WAIT_S]:
                        del self.early[event_id]
                while self._due and self._due[0][0] <= time.monotonic() and not self._stop.is_set():
                    _, entry, sample = self._due.popleft()
                    entry["replayed"] = self._replay(sample)
        finally:
            consumer.close()

    def _replay(self, sample: dict) -> dict | None:
        body = {"user_id": sample["user_id"], "ts": sample["ts"], "return_features": True,
                "context": {"device": sample["device"], "local_hour": sample["local_hour"]},
                "candidates": [{k: sample[k] for k in CANDIDATE_FIELDS}]}
        answer = self._predict(body)
        if answer is None:
            return None
        return {"differing": differing_features(self.spec, answer["features"][0], sample), "as_of": answer["features_as_of"],
                "ts": sample["ts"]}

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.compared)


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
