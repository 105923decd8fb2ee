"""The streaming job's settings: raw events in; labelled samples, rejected events and the
per-entity feature state out.

The job itself is Java (``pipelines/java/streamrec/flink/SampleJob.java``; docs/pipeline.md
has the graph, the state and the late-data policy): a DataStream program whose keyed
stages see each key's events in event-time order and touch their state once per key and
watermark. :class:`JobSpec` is everything it needs to know, handed over as
``java.util.Properties`` text (:meth:`JobSpec.properties`).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from streamrec.contracts import events as ev
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.contracts.validation_spec import validation_spec

LATE_EVENT = "late_event"  # reason code of valid events behind the watermark (docs/pipeline.md)
ORPHAN_REASON = f"{ev.ORPHAN_CLICK}: no impression of its (request_id, item_id) within the attribution window"


@dataclass(frozen=True)
class JobSpec:
    bootstrap: str
    events_topic: str
    samples_topic: str
    dlq_topic: str
    group_id: str
    feature_spec: FeatureSpec
    out_of_orderness_ms: int
    idle_timeout_ms: int
    exactly_once: bool
    transactional_prefix: str
    # RocksDB only: recently used key states kept in memory per stage (StateCache.java); 0 = off
    state_cache_keys: int
    # the stages' per-entity state to features_topic after each watermark (FeatureState.java); its
    # event times in buckets of feature_bucket_ms; features_partitions: that topic's partitions
    features_topic: str
    feature_state: bool
    feature_bucket_ms: int
    features_partitions: int
    bounded: bool = False  # stop at the topic's current end (tests, backfills)
    # One source reader per partition: a reader's watermark only covers the partitions it
    # has started reading, so a reader with several partitions of backlog would run its
    # watermark ahead of the partitions it has not reached yet and drop them as late.
    source_parallelism: int = 1

    @classmethod
    def from_config(cls, cfg, source_parallelism: int = 1, bounded: bool = False, features_partitions: int | None = None) -> "JobSpec":
        """The job of this config (``source_parallelism``: one reader per events partition;
        ``features_partitions``: of the features topic, default kafka.partitions)."""
        k, t, f = cfg.kafka, cfg.topics, cfg.flink
        return cls(
            bootstrap=k.bootstrap_servers, events_topic=t.events, samples_topic=t.samples, dlq_topic=t.dlq,
            group_id=f.group_id, feature_spec=cfg.features, out_of_orderness_ms=f.out_of_orderness_ms,
            idle_timeout_ms=math.ceil(f.idle_timeout_s * 1000), exactly_once=f.delivery == "exactly-once",
            transactional_prefix=f.job_name,
            # the heap backend holds the objects already (and must not see them change under its snapshots)
            state_cache_keys=f.state_cache_keys if f.state_backend == "rocksdb" else 0,
            bounded=bounded, source_parallelism=source_parallelism,
            features_topic=t.features, feature_state=f.feature_state, feature_bucket_ms=f.feature_bucket_s * 1000,
            features_partitions=features_partitions or k.partitions,
        )

    def idle_timeout_for(self, restored: bool) -> int:
        """The job's idle timeout (ms, 0 = no idleness). A bounded run has none: each of its
        partitions ends, and a reader that stalls must hold the watermark back, not have its
        events lost (test_a_bounded_run_never_treats_a_partition_as_idle). Unless it resumes
        from a checkpoint: its restored partitions keep that run's end offsets (none, if it was
        unbounded), so a quiet one might never end."""
        return 0 if self.bounded and not restored else self.idle_timeout_ms

    def properties(self, restored: bool = False) -> str:
        """The settings as java.util.Properties text, for SampleJob.build (``restored``: the job
        resumes from a checkpoint)."""
        self.feature_spec.validate()
        if self.idle_timeout_ms < 0:
            raise ValueError(f"idle_timeout_ms must be >= 0 (0 = no idleness), got {self.idle_timeout_ms}")
        if self.state_cache_keys < 0:
            raise ValueError(f"state_cache_keys must be >= 0 (0 = off), got {self.state_cache_keys}")
        if self.feature_bucket_ms < 1000 or self.features_partitions < 1:
            raise ValueError(f"feature_bucket_ms must be >= 1000 and features_partitions >= 1, got "
                             f"{self.feature_bucket_ms} and {self.features_partitions}")
        values = {
            "bootstrap": self.bootstrap, "events_topic": self.events_topic, "samples_topic": self.samples_topic,
            "dlq_topic": self.dlq_topic, "group_id": self.group_id, "bounded": str(self.bounded).lower(),
            "exactly_once": str(self.exactly_once).lower(), "transactional_prefix": self.transactional_prefix,
            "source_parallelism": str(self.source_parallelism), "out_of_orderness_ms": str(self.out_of_orderness_ms),
            "idle_timeout_ms": str(self.idle_timeout_for(restored)), "max_future_skew_ms": str(ev.MAX_FUTURE_SKEW_MS),
            "validation_spec": validation_spec(), "late_reason": LATE_EVENT, "orphan_reason": ORPHAN_REASON,
            **self.feature_spec.job_properties(),
            "state_cache_keys": str(self.state_cache_keys),
            "features_topic": self.features_topic, "feature_state": str(self.feature_state).lower(),
            "feature_bucket_ms": str(self.feature_bucket_ms), "features_partitions": str(self.features_partitions),
        }
        return "".join(f"{key}={_escape(value)}\n" for key, value in values.items())


def _escape(value: str) -> str:
    """java.util.Properties escaping of a value (backslash, line breaks, leading blanks, unicode)."""
    out = value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    out = "".join(c if ord(c) < 128 else f"\\u{ord(c):04x}" for c in out)
    return "\\" + out if out.startswith(" ") else out
