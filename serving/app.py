"""The HTTP API of a serving node (DESIGN.md), on FastAPI.

Routes: ``POST /v1/models/{model}:predict``, ``GET /v1/models/{model}``,
``POST /v1/models/{model}:reload`` and ``:rollback`` (admin: bearer token),
``GET /healthz``, ``GET /readyz``, ``GET /metrics``. Every error is JSON
``{"error": {"code": <http status>, "message": "..."}}`` with a message that says what is
wrong; no input can take the server down. The OpenAPI schema is at ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipelines.samples import SampleSpec
from ps.model_store import CorruptVersion
from serving.batcher import RequestBatcher
from serving.errors import ApiError, not_loaded, unknown_model
from serving.frontend import FrontendPlan, FrontendPool
from serving.ipc import EngineLink
from serving.pauses import GcPauses
from serving.request import InstanceDecoder, invalid_instances
from serving.state import ServedModel
from streamrec import __version__
from streamrec.config import ServingConfig
from trainer.columns import FeatureColumns
from trainer.features import batch_from_columns

log = logging.getLogger("streamrec.serving")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message}}, status_code=status)


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


def create_app(served: ServedModel, settings: ServingConfig, frontends: FrontendPlan | None = None,
               gc_pauses: GcPauses | None = None) -> FastAPI:
    """The engine's API; with ``frontends`` it also starts those processes and answers the
    predict requests they send over the Unix socket (serving/frontend.py)."""
    metrics = ServingMetrics()
    model_name = served.model_store.model

    decoders: dict[SampleSpec, InstanceDecoder] = {}

    def decoder_for(spec: SampleSpec) -> InstanceDecoder:
        if spec not in decoders:  # one per sample spec of the served versions (normally one)
            decoders[spec] = InstanceDecoder(spec, settings.max_instances)
        return decoders[spec]

    def run_batch(payloads: list) -> list:
        """Check, convert and score every request of a batch in one pass (a worker thread).

        A payload is a request's decoded instances (this process's HTTP) or its checked
        :class:`FeatureColumns` (from a front-end process, serving/frontend.py). A request with
        an invalid instance gets a 400 naming them; the others are scored."""
        current = served.current
        if current is None:
            raise not_loaded()
        decoder = decoder_for(current.sample_spec)
        outcomes: list = [None] * len(payloads)
        width = len(current.sample_spec.counter_columns())
        for r, payload in enumerate(payloads):
            mine = payload.counters.shape[1] == width if isinstance(payload, FeatureColumns) else type(payload[0]) is decoder.instance
            if not mine:
                outcomes[r] = ApiError(503, "the served model's sample schema changed while this request waited; send it again")
        listed = [r for r, p in enumerate(payloads) if outcomes[r] is None and not isinstance(p, FeatureColumns)]
        parts, order = [], []
        if listed:
            flat = [x for r in listed for x in payloads[r]]
            columns, rejected = decoder.columns(flat)
            if rejected:  # rare: name each bad instance to its request, score the other requests
                where = [(r, j) for r in listed for j in range(len(payloads[r]))]
                bad: dict[int, list[str]] = {}
                for i, reason in rejected:
                    r, j = where[i]
                    bad.setdefault(r, []).append(f"instance {j}: {reason}")
                for r, reasons in bad.items():
                    outcomes[r] = invalid_instances(reasons)
                listed = [r for r in listed if r not in bad]
                columns = decoder.columns([x for r in listed for x in payloads[r]])[0] if listed else None
            if listed:
                parts.append(columns)
                order.extend(listed)
        for r, payload in enumerate(payloads):
            if outcomes[r] is None and isinstance(payload, FeatureColumns):
                parts.append(payload)
                order.append(r)
        version, scores = current.version, np.empty(0, np.float32)
        if parts:
            batch = batch_from_columns(FeatureColumns.concat(parts), current.sample_spec, current.model.spec.history_len)
            version, scores = served.predict(batch, now_ms=int(time.time() * 1000))
        taken = 0
        for r in order:
            n = len(payloads[r])
            outcomes[r] = (version, scores[taken: taken + n])
            taken += n
        return outcomes

    batcher = RequestBatcher(run_batch, settings.max_batch, settings.max_delay_us, settings.workers)

    async def score(payload) -> tuple[int, np.ndarray]:
        """One request's (version, scores) through the batcher, counted in the metrics."""
        t0 = time.perf_counter()
        status = "error"
        try:
            result = await batcher.submit(payload)
            metrics.queued.observe(result.queued_s)
            metrics.instances.inc(len(payload))
            status = "ok"
            return result.version, result.scores
        finally:
            metrics.requests.labels(status).inc()
            metrics.latency.observe(time.perf_counter() - t0)

    def hello() -> tuple:
        current = served.current
        return ("hello", model_name, current.sample_spec.to_json() if current is not None else None)

    link = EngineLink(frontends.socket_path, hello, score) if frontends else None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        pool = None
        if link is not None:
            await link.start()
            pool = FrontendPool(frontends).start()
        yield
        if pool is not None:  # front-ends drain their in-flight requests through the engine first
            await asyncio.get_running_loop().run_in_executor(None, pool.stop)
            await link.stop()
        await batcher.stop()

    app = FastAPI(title="streamrec serving", version=__version__, lifespan=lifespan,
                  description="Online CTR predictions from a continuously updated model.")
    app.state.served, app.state.metrics, app.state.batcher = served, metrics, batcher

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    def check_model(model: str) -> None:
        if model != model_name:
            raise unknown_model(model, model_name)

    def check_admin(request: Request) -> None:
        if not settings.admin_token:
            raise ApiError(403, "admin routes are disabled: set serving.admin_token (or STREAMREC_SERVING__ADMIN_TOKEN)")
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer ") or not hmac.compare_digest(header[7:].encode(), settings.admin_token.encode()):
            raise ApiError(401, "admin route: send 'Authorization: Bearer <serving.admin_token>'")

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise ApiError(413, f"request body of {int(length):,} bytes exceeds serving.max_body_bytes ({settings.max_body_bytes:,})")
        body = await request.body()
        if len(body) > settings.max_body_bytes:
            raise ApiError(413, f"request body exceeds serving.max_body_bytes ({settings.max_body_bytes:,})")
        return body

    async def read_json(request: Request, optional: bool = False) -> dict:
        body = await read_body(request)
        if not body.strip() and optional:
            return {}
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    async def predict_body(model: str, body: bytes) -> bytes:
        """The predict route's work, shared by the FastAPI route and the PredictShortcut."""
        check_model(model)  # the body's size was checked as it was read (read_body, PredictShortcut)
        current = served.current
        if current is None:
            raise not_loaded()
        version, scores = await score(decoder_for(current.sample_spec).decode(body))
        return orjson.dumps({"model_version": version, "scores": scores.tolist()})

    app.state.predict_body = predict_body

    @app.post("/v1/models/{model}:predict")
    async def predict(model: str, request: Request) -> Response:
        """Scores for ``{"instances": [sample without label, ...]}``. (`streamrec serve` answers
        this route through :class:`PredictShortcut`, with the same code and errors.)"""
        return Response(await predict_body(model, await read_body(request)), media_type="application/json")

    @app.get("/v1/models/{model}")
    async def model_status(model: str) -> dict[str, Any]:
        """The served version, the versions rollback can reach, freshness."""
        check_model(model)
        current = served.current
        through = current.manifest.get("trained_through_ms") if current else None
        return {
            "model": model_name,
            "model_version": served.version,
            "kind": current.manifest.get("kind") if current else None,
            "trained_through_ms": through,
            "freshness_s": (time.time() * 1000 - through) / 1000 if through else None,
            "applied_at": served.applied_at.get(served.version) if served.version else None,
            "rollback_to": sorted({u.version_before for u in served.undo}),
            "pinned": served.pinned,
            "refused": {str(v): why for v, why in served.refused.items()},
            "latest_in_store": served.model_store.latest(),
            "runtime": current.runner.stats.as_json() if current is not None and current.runner is not None else None,
            "batching": batcher.stats.as_json(),
            "gc": gc_pauses.as_json() if gc_pauses is not None else None,
        }

    async def admin_call(fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except (LookupError, CorruptVersion) as exc:
            raise ApiError(409 if isinstance(exc, LookupError) else 422, str(exc)) from None

    def version_arg(body: dict) -> int | None:
        version = body.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
            raise ApiError(400, f"'version' must be a positive integer, got {version!r}")
        return version

    @app.post("/v1/models/{model}:reload")
    async def reload(model: str, request: Request) -> dict[str, Any]:
        """``{"version": N}``: serve N and stay on it (pinned); ``{}``: release any pin and
        catch up to LATEST."""
        check_model(model)
        check_admin(request)
        version = version_arg(await read_json(request, optional=True))
        if version:
            reports = [await admin_call(served.load, version, True)]
        else:
            served.release()
            reports = await admin_call(served.catch_up)
        return {"model_version": served.version, "applied": [r.__dict__ for r in reports], "pinned": served.pinned}

    @app.post("/v1/models/{model}:rollback")
    async def rollback(model: str, request: Request) -> dict[str, Any]:
        """Back to ``{"version": N}`` or the previous version; pins it until :reload."""
        check_model(model)
        check_admin(request)
        version = version_arg(await read_json(request, optional=True))
        report = await admin_call(served.rollback, version)
        return {"model_version": served.version, "previous": report.previous, "seconds": report.locked_s, "pinned": served.pinned}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if served.version is None:
            return _error(503, "no model version loaded yet")
        if link is not None and link.connected < frontends.count:
            return _error(503, f"{link.connected} of {frontends.count} HTTP front-ends connected")
        return JSONResponse({"status": "ready", "model_version": served.version})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if served.version is not None:
            metrics.version.set(served.version)
            through = served.current.manifest.get("trained_through_ms") if served.current else None
            if through:
                metrics.freshness.set(through)
            if served.current is not None and served.current.runner is not None:
                metrics.observe_runtime(served.current.runner.stats.as_json())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

