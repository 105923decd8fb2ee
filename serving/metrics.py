"""The serving node's Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServingMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("streamrec_serving_requests", "predict requests", ["status"], registry=r)
        self.instances = Counter("streamrec_serving_instances", "instances scored", registry=r)
        self.latency = Histogram("streamrec_serving_request_seconds", "predict request latency", registry=r,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))
        self.queued = Histogram("streamrec_serving_queue_seconds", "time a request waited for its batch", registry=r,
                                buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        self.version = Gauge("streamrec_serving_model_version", "version being served", registry=r)
        self.freshness = Gauge("streamrec_serving_trained_through_ms", "event time the served version is trained through", registry=r)
        self.buckets = Gauge("streamrec_serving_compiled_buckets", "shape buckets built for the served version", registry=r)
        self.eager = Gauge("streamrec_serving_eager_batches", "batches of the served version run eagerly (out of every bucket)", registry=r)
        self.device_ms = Gauge("streamrec_serving_device_ms_per_batch", "mean forward time per batch on the device, by bucket",
                               ["bucket"], registry=r)

    def observe_runtime(self, stats: dict) -> None:
        self.buckets.set(stats["compiled_buckets"])
        self.eager.set(stats["eager_batches"])
        for bucket, s in stats["buckets"].items():
            if s["device_ms_per_batch"] is not None:
                self.device_ms.labels(bucket).set(s["device_ms_per_batch"])
