"""The serving node's Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServingMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("streamrec_serving_requests", "predict requests", ["status"], registry=r)
        self.instances = Counter("streamrec_serving_instances", "instances scored", registry=r)
        self.shed = Counter("streamrec_serving_shed_requests", "predict requests answered 503 unrun: queue full or waited past "
                            "serving.queue_timeout_ms", ["reason"], registry=r)
        for reason in ("queue_full", "deadline"):
            self.shed.labels(reason)
        self.latency = Histogram("streamrec_serving_request_seconds", "predict request latency", registry=r,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))
        self.queued = Histogram("streamrec_serving_queue_seconds", "time a request waited for its batch", registry=r,
                                buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        self.version = Gauge("streamrec_serving_model_version", "version being served", registry=r)
        self.freshness = Gauge("streamrec_serving_trained_through_ms", "event time the served version is trained through", registry=r)
        self.pinned = Gauge("streamrec_serving_pinned_version", "version the store's pin holds every node on (0: none)", registry=r)
        self.latest_unusable = Gauge("streamrec_serving_latest_unusable",
                                     "1 while LATEST is garbage or dangling (the newest version that verifies is followed)", registry=r)
        self.refused = Gauge("streamrec_serving_refused_versions", "versions refused (corrupt, non-finite, incompatible)", registry=r)
        self.buckets = Gauge("streamrec_serving_compiled_buckets", "shape buckets built for the served version", registry=r)
        self.eager = Gauge("streamrec_serving_eager_batches", "batches of the served version run eagerly (out of every bucket)", registry=r)
        self.device_ms = Gauge("streamrec_serving_device_ms_per_batch", "mean forward time per batch on the device, by bucket",
                               ["bucket"], registry=r)

        self.assembly = Histogram("streamrec_features_assembly_seconds", "online feature assembly per batch of predict-by-ids requests",
                                  registry=r, buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01))
        self.features_as_of = Gauge("streamrec_features_as_of_ms", "every event before this time is in the feature store", registry=r)
        self.features_lag = Gauge("streamrec_features_lag_ms", "wall clock minus features_as_of", registry=r)
        self.features_lag_records = Gauge("streamrec_features_lag_records", "features-topic records not yet applied", registry=r)
        self.features_entities = Gauge("streamrec_features_entities", "entities in the feature store", ["kind"], registry=r)
        self.features_memory = Gauge("streamrec_features_memory_bytes", "feature store memory (estimate)", registry=r)
        self.features_refused = Gauge("streamrec_features_refused_records", "records of new entities refused: the store was over its "
                                      "memory budget (serving.feature_store_memory_mb)", registry=r)
        self.features_over_budget = Gauge("streamrec_features_over_budget", "1 while the feature store admits no new entity", registry=r)
        self.features_corrupt = Gauge("streamrec_features_corrupt_messages", "corrupt features-topic messages skipped", registry=r)

    def observe_features(self, status: dict) -> None:
        if status["features_as_of"] is not None:
            self.features_as_of.set(status["features_as_of"])
            self.features_lag.set(status["lag_ms"])
        self.features_lag_records.set(status["lag_records"])
        for kind, n in status["entities"].items():
            self.features_entities.labels(kind).set(n)
        self.features_memory.set(status["memory_bytes"])
        self.features_refused.set(status["refused"])
        self.features_over_budget.set(1 if status["over_budget"] else 0)
        self.features_corrupt.set(status["corrupt"])

    def observe_runtime(self, stats: dict) -> None:
        self.buckets.set(stats["compiled_buckets"])
        self.eager.set(stats["eager_batches"])
        for bucket, s in stats["buckets"].items():
            if s["device_ms_per_batch"] is not None:
                self.device_ms.labels(bucket).set(s["device_ms_per_batch"])
