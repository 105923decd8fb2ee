"""The serving node's Prometheus metrics (``GET /metrics``): one registry per node; what
belongs to one served model carries its ``model`` label (:class:`ModelMetrics` binds it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServingMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        m = ["model"]
        self.requests = Counter("streamrec_serving_requests", "predict requests", m + ["status"], registry=r)
        self.instances = Counter("streamrec_serving_instances", "instances scored", m, registry=r)
        self.shed = Counter("streamrec_serving_shed_requests", "predict requests answered 503 unrun: queue full or waited past "
                            "serving.queue_timeout_ms", m + ["reason"], registry=r)
        self.latency = Histogram("streamrec_serving_request_seconds", "predict request latency", m, registry=r,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))
        self.queued = Histogram("streamrec_serving_queue_seconds", "time a request waited for its batch", m, registry=r,
                                buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        self.version = Gauge("streamrec_serving_model_version", "version being served", m, registry=r)
        self.freshness = Gauge("streamrec_serving_trained_through_ms", "event time the served version is trained through", m, registry=r)
        self.pinned = Gauge("streamrec_serving_pinned_version", "version the store's pin holds every node on (0: none)", m, registry=r)
        self.latest_unusable = Gauge("streamrec_serving_latest_unusable",
                                     "1 while LATEST is garbage or dangling (the newest version that verifies is followed)", m, registry=r)
        self.refused = Gauge("streamrec_serving_refused_versions", "versions refused (corrupt, non-finite, incompatible)", m, registry=r)
        self.buckets = Gauge("streamrec_serving_compiled_buckets", "shape buckets built for the served version", m, registry=r)
        self.eager = Gauge("streamrec_serving_eager_batches", "batches of the served version run eagerly (out of every bucket)", m,
                           registry=r)
        self.device_ms = Gauge("streamrec_serving_device_ms_per_batch", "mean forward time per batch on the device, by bucket",
                               m + ["bucket"], registry=r)
        self.fan_out = Counter("streamrec_serving_fan_out_requests", "by-ids requests scored by several models at once", registry=r)
        self.shadow = Counter("streamrec_serving_shadow_requests", "requests also scored by a shadow model, by outcome",
                              ["model", "outcome"], registry=r)
        self.prediction_log = Gauge("streamrec_serving_prediction_log_records", "prediction log records (serving.prediction_log), "
                                    "by outcome: queued, sent, dropped (its queue full), failed (the broker refused them)",
                                    ["outcome"], registry=r)

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



class _Bound:
    """A labelled metric with its ``model`` label given: ``.labels(rest...)``."""

    __slots__ = ("metric", "model")

    def __init__(self, metric, model: str) -> None:
        self.metric, self.model = metric, model

    def labels(self, *rest: str):
        return self.metric.labels(self.model, *rest)


class ModelMetrics:
    """One served model's share of the node's :class:`ServingMetrics` (its ``model`` label set)."""

    def __init__(self, node: ServingMetrics, model: str) -> None:
        self.node = node
        self.requests, self.shed, self.device_ms = (_Bound(x, model) for x in (node.requests, node.shed, node.device_ms))
        for name in ("instances", "latency", "queued", "version", "freshness", "pinned", "latest_unusable", "refused", "buckets", "eager"):
            setattr(self, name, getattr(node, name).labels(model))
        for reason in ("queue_full", "deadline"):
            self.shed.labels(reason)
        self.answered = self.requests.labels("ok")  # counted per request: the child looked up once
        self.assembly = node.assembly

    def observe_runtime(self, stats: dict) -> None:
        self.buckets.set(stats["compiled_buckets"])
        self.eager.set(stats["eager_batches"])
        for bucket, s in stats["buckets"].items():
            if s["device_ms_per_batch"] is not None:
                self.device_ms.labels(bucket).set(s["device_ms_per_batch"])
