"""`streamrec serve`: load the models, follow their new versions, serve HTTP until stopped."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from streamrec.model.device import pick_device
from streamrec.model.network import inference_cache_rows
from streamrec.modelstore.store import ModelStore
from streamrec.serving.http.app import create_app
from streamrec.modelstore.experiments import ExperimentStore
from streamrec.serving.runtime.batcher import BatcherGroup
from streamrec.serving.runtime.model_runtime import ModelRuntime
from streamrec.serving.access.experiments import Experiments
from streamrec.serving.access.prediction_log import PredictionLog
from streamrec.serving.access.quotas import Callers
from streamrec.serving.runtime.metrics import ModelMetrics, ServingMetrics
from streamrec.serving.node import ServingNode
from streamrec.serving.features.online_features import OnlineFeatures
from streamrec.serving.http.frontend import FrontendPlan
from streamrec.serving.http.guard import HttpLimits, throttle_logs
from streamrec.plumbing.gc_pauses import GcPauses, freeze_heap
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.http.shortcut import PredictShortcut
from streamrec.serving.runtime.state import ServedModel
from streamrec.serving.runtime.watcher import UpdateListener, VersionWatcher
from streamrec.plumbing.bus.broker import free_port
from streamrec.plumbing.config import Config, served_model_names

log = logging.getLogger("streamrec.serving")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (the process then dies
    by the signal); we stop the watcher and release the model first, and exit 0. uvicorn's
    own lines are off (log_level "warning"): this one says where it listens and when it stops."""

    def __init__(self, config: uvicorn.Config, listening: str) -> None:
        super().__init__(config)
        self.listening = listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("%s", self.listening)

    async def shutdown(self, sockets=None) -> None:
        log.info("stopping: no new connections; requests in flight finish (up to %d s)", self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)

    @contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(cfg: Config) -> None:
    """Blocks until SIGINT/SIGTERM; uvicorn then stops accepting and drains in-flight requests."""
    s = cfg.serving
    started = time.monotonic()
    sys.setswitchinterval(s.switch_interval_us / 1e6)
    throttle_logs()
    device = pick_device(s.device, "serving.device")
    runtime = RuntimeConfig.from_serving(s)
    runtime.resolved_mode(device)  # a bad mode for this device fails here, not at the first version
    stores = {m.name: m.model_store or s.model_store for m in s.models} or {cfg.model.name: s.model_store}
    served = [ServedModel(ModelStore(root, name), device, inference_cache_rows(cfg.model, cfg.ps), s.undo_depth, runtime, cfg.features)
              for name, root in stores.items()]
    for model in served:
        for report in model.catch_up():
            log.info("loaded version %d of %s (%d rows)", report.version, model.model_store.model, report.rows)
        if model.version is None:
            log.warning("no version of %s under %s yet: /readyz answers 503 until one is published", model.model_store.model,
                        stores[model.model_store.model])
    freeze_heap()  # the loaded models' objects: full collections no longer walk them (plumbing/gc_pauses.py)
    watchers = [VersionWatcher(model, s.poll_interval_s, UpdateListener(cfg.kafka.bootstrap_servers, cfg.topics.model_updates,
                                                                        model.model_store.model) if s.follow_updates else None).start()
                for model in served]
    private = Path(tempfile.mkdtemp(prefix="streamrec-serve-")) if s.frontends else None  # 0700: only we reach the socket
    limits = HttpLimits.from_serving(s)
    plan = FrontendPlan(s.frontends, str(private / "serving.sock"), free_port(), s.host, s.port, s.max_body_bytes,
                        s.max_instances, limits, s.switch_interval_us, s.caller_header, s.priority_header) if private else None
    features = None
    if s.feature_store:
        features = OnlineFeatures(cfg.kafka.bootstrap_servers, cfg.topics.features, cfg.features, s.feature_store_memory_mb,
                                  s.feature_store_dir, cfg.kafka.connect_timeout_s, s.feature_snapshot or None,
                                  s.feature_snapshot_interval_s).start()
        log.info("online features: materialising %s (ready once caught up)", cfg.topics.features)
    metrics = ServingMetrics()
    batchers = BatcherGroup()
    model_runtimes = [ModelRuntime(model, s, ModelMetrics(metrics, model.model_store.model), features, batchers) for model in served]
    node = ServingNode(model_runtimes, s, metrics, features, GcPauses().install(), **model_access(cfg, metrics))
    app = PredictShortcut(create_app(node, plan), node.predict, s.max_body_bytes, s.caller_header, s.priority_header)
    if plan is not None:
        log.info("%d HTTP front-ends on %s:%d; serving process API on 127.0.0.1:%d", plan.count, s.host, s.port, plan.serving_port)
    try:
        # lifespan "on": FastAPI's lifespan starts the batchers (uvicorn's "auto" would too, but
        # only after probing the wrapper); no proxy headers: nothing here reads the client address.
        # With front-ends they own the public port and this process listens on the loopback only.
        host, port = ("127.0.0.1", plan.serving_port) if plan else (s.host, s.port)
        _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10,
                               lifespan="on", proxy_headers=False, **limits.uvicorn_options()),
                listening_line(list(stores), s.host, s.port, s.frontends)).run()
    finally:
        for watcher in watchers:
            watcher.stop()
        node.close()
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        log.info("stopped after %.0f s: %s predict requests answered", time.monotonic() - started, f"{answered(metrics):,.0f}")


def listening_line(models: list[str], host: str, port: int, frontends: int) -> str:
    """What the node says once its port is open: where to send requests, and how to stop it."""
    address = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    through = f" through {frontends} HTTP front-end{'s' if frontends != 1 else ''}" if frontends else ""
    return (f"serving {', '.join(models)} on {address}{through} (predict: POST /v1/models/{models[0]}:predict; "
            "Ctrl-C or SIGTERM stops it)")


def answered(metrics: ServingMetrics) -> float:
    """Predict requests answered so far, whatever their status, over every model."""
    return sum(sample.value for family in metrics.requests.collect() for sample in family.samples
               if sample.name.endswith("_total"))


def model_access(cfg: Config, metrics: ServingMetrics) -> dict:
    """The node's experiments (with their run-time changes in the model store), callers and
    prediction log, as configured (None: off)."""
    s = cfg.serving
    experiments = Experiments(s.experiments, served_model_names(cfg), ExperimentStore(s.model_store))
    try:
        experiments.refresh()
    except (OSError, ValueError) as exc:
        log.warning("experiments changed at run time cannot be read from %s (%s): serving the configured ones", s.model_store, exc)
    callers = Callers.from_config(s, metrics.registry) if s.callers or s.anonymous_rate_per_s else None
    return {"experiments": experiments, "callers": callers, "prediction_log": PredictionLog.from_config(cfg) if s.prediction_log else None}
