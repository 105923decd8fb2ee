"""`streamrec serve`: load the model, follow new versions, serve HTTP until stopped."""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager

import uvicorn

from ps.model_store import ModelStore
from serving.app import create_app
from serving.runner import RuntimeConfig
from serving.state import ServedModel
from serving.watcher import UpdateListener, VersionWatcher
from streamrec.config import Config
from trainer.engine import pick_device

log = logging.getLogger("streamrec.serving")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (the process then dies
    by the signal); we stop the watcher and release the model first, and exit 0."""

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
    device = pick_device(s.device)
    runtime = RuntimeConfig.from_serving(s)
    runtime.resolved_mode(device)  # a bad mode for this device fails here, not at the first version
    served = ServedModel(ModelStore(s.model_store, cfg.model.name), device, cfg.model.gpu_cache_rows, s.undo_depth, runtime)
    for report in served.catch_up():
        log.info("loaded version %d of %s (%d rows)", report.version, cfg.model.name, report.rows)
    if served.version is None:
        log.warning("no version of %s under %s yet: /readyz answers 503 until one is published", cfg.model.name, s.model_store)
    listener = UpdateListener(cfg.kafka.bootstrap_servers, cfg.topics.model_updates, cfg.model.name) if s.follow_updates else None
    watcher = VersionWatcher(served, s.poll_interval_s, listener).start()
    app = create_app(served, s)
    try:
        _Server(uvicorn.Config(app, host=s.host, port=s.port, log_level="warning", timeout_graceful_shutdown=10)).run()
    finally:
        watcher.stop()
        served.close()
