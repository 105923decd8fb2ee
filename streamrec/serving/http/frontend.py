"""HTTP front-end processes: more cores for predict's HTTP and JSON work, one serving process.

With ``serving.frontends = K > 0``, `streamrec serve` (the *serving process*: models, batchers,
GPU, hot-swap, admin) starts K of these processes. Each listens on the public port with
SO_REUSEPORT (the kernel spreads connections over them), decodes and checks predict bodies
into feature columns (serving/runtime/request.py) and sends the columns to the serving process over
a Unix socket (serving/runtime/ipc.py); every other route is relayed unchanged to the serving
process's HTTP port on the loopback. Why: one Python process tops out where its event loop and its
batch workers share one GIL (bench/RESULTS.md, serving); the serving process then spends its GIL
on batches, not on HTTP parsing and JSON.

Run by the serving process as ``python -m streamrec.serving.http.frontend --socket S --serving-port P --host H --port N ...``;
not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import orjson
import uvicorn

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.plumbing.processes import python_env
from streamrec.serving.errors import ApiError, SpecChanged, not_loaded
from streamrec.serving.access.experiments import Experiments, entry_from_json
from streamrec.serving.http.guard import HttpLimits, throttle_logs
from streamrec.serving.by_ids import ByIdsQuery, answer_json, fan_out_json
from streamrec.serving.runtime.ipc import TO_FRONTEND, Outbox, frame, pack_columns, read_frame
from streamrec.serving.runtime.messages import PROTOCOL, Call, Failed, Hello, PredictByIds, PredictColumns, Requests, Welcome
from streamrec.plumbing.gc_pauses import freeze_heap
from streamrec.serving.access.quotas import OverQuota
from streamrec.serving.runtime.request import InstanceDecoder
from streamrec.serving.access.routing import RequestRouter
from streamrec.serving.http.shortcut import PredictShortcut, read_body, send_answer

log = logging.getLogger("streamrec.serving.frontend")
HOP_HEADERS = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length"}  # send_answer sets the length
# answer headers not relayed back: the hop headers, and those the front-end's uvicorn adds to
# every answer itself (relayed as well, a client would get two)
NOT_RELAYED_BACK = HOP_HEADERS | {b"date", b"server"}


class ServingProcessClient:
    """A front-end's multiplexed connection to the serving process (one socket, answers by id).
    It decodes, checks and routes every predict body itself (serving/access/routing.py); the
    serving process gets typed, ready-made requests."""

    def __init__(self, path: str, max_instances: int) -> None:
        self.path, self.max_instances = path, max_instances
        self.models: dict[str, dict | None] = {}  # name -> the feature spec of its served version
        self.router: RequestRouter | None = None
        self._decoders: dict[str, InstanceDecoder] = {}
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._hello: asyncio.Future | None = None
        self._outbox: Outbox | None = None  # requests, sent as one Requests frame at the end of the loop's turn

    async def connect(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                self._outbox = Outbox(self._writer, Requests)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the serving process's socket {self.path} did not open in {timeout_s:.0f} s") from None
                await asyncio.sleep(0.1)
        asyncio.create_task(self._read(reader), name="serving-answers")
        await self.hello()

    async def hello(self) -> None:
        """Learn the served models, their feature specs and the experiments (again after a
        :class:`Failed` that says a spec may have changed). Concurrent callers share one exchange."""
        if self._hello is None or self._hello.done():
            self._hello = asyncio.get_running_loop().create_future()
            self._writer.write(frame(Hello()))
        self.welcome(await asyncio.shield(self._hello))

    def welcome(self, welcome: Welcome) -> None:
        if welcome.protocol != PROTOCOL:
            raise RuntimeError(f"the serving process speaks link protocol {welcome.protocol}, this front-end {PROTOCOL}: "
                               "they run different streamrec versions; restart the serving process")
        self.models = welcome.models
        self._decoders = {}
        experiments = Experiments([entry_from_json(e) for e in welcome.experiments], list(welcome.models)) if welcome.experiments else None
        self.router = RequestRouter(self._decoder_of, self._served, welcome.by_ids, self.max_instances, welcome.max_future_skew_ms,
                                    experiments)

    def _served(self, model: str) -> None:
        if model not in self.models:
            raise ApiError(404, f"unknown model {model!r}; this node serves {sorted(self.models)}")

    def _decoder_of(self, model: str) -> InstanceDecoder:
        self._served(model)
        spec = self.models[model]
        if spec is None:
            raise not_loaded()
        if model not in self._decoders:
            self._decoders[model] = InstanceDecoder(FeatureSpec.from_json(spec), self.max_instances)
        return self._decoders[model]

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_frame(reader, TO_FRONTEND)
                if isinstance(message, Welcome):
                    if self._hello is not None and not self._hello.done():
                        self._hello.set_result(message)
                    else:  # unasked: the experiments changed
                        self.welcome(message)
                    continue
                for answer in message.items:
                    future = self._pending.pop(answer.id, None)
                    if future is not None and not future.done():
                        future.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.error("the serving process closed the link; this front-end stops")
            why = "the serving process went away; retry"
        except Exception:  # noqa: BLE001 -- an unreadable message: this process cannot match answers any more
            log.exception("unreadable message from the serving process (another streamrec version?); this front-end stops")
            why = "this front-end could not read the serving process's answer; retry"
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ApiError(503, why))
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn drains and exits

    async def predict_body(self, kind: str, name: str, body: bytes, timeout_s: float | None = None, call: Call = Call()) -> bytes:
        try:
            routed = self.router.route(kind, name, body, call)
        except SpecChanged:  # no version was loaded when we last asked
            await self.hello()
            routed = self.router.route(kind, name, body, call)
        request_id = next(self._ids)
        query = routed.payload
        if isinstance(query, ByIdsQuery):
            message = PredictByIds(request_id, routed.model, timeout_s, query.user_id, query.ts, query.device, query.local_hour,
                                   query.candidates.tobytes(), query.return_features, routed.fan_out, routed.call)
        else:
            message = PredictColumns(request_id, routed.model, timeout_s, *pack_columns(query), routed.call)
        future = self._pending[request_id] = asyncio.get_running_loop().create_future()
        self._outbox.put(message)
        answer = await future
        if isinstance(answer, Failed):
            if answer.spec_changed:
                await self.hello()
            if answer.retry_after_s is not None:
                raise OverQuota(answer.message, answer.retry_after_s)
            raise ApiError(answer.status, answer.message)
        if answer.fan_out is not None:
            return fan_out_json(query.ts, answer.features_as_of, answer.features_stale, answer.features, answer.fan_out)
        scores = np.frombuffer(answer.scores, np.float32).tolist()
        if not answer.by_ids:
            return orjson.dumps({"model_version": answer.model_version, "scores": scores, **routed.extra})
        return answer_json(answer.model_version, answer.features_as_of, answer.features_stale, query.ts, scores, answer.features,
                           routed.extra)


class ServingRelay:
    """The ASGI app for every route but predict: relays the request to the serving process's
    HTTP port (rare, admin-speed traffic: a blocking client on a thread is enough), and runs the
    front-end's lifespan (connect to the serving process at start-up)."""

    def __init__(self, client: ServingProcessClient, serving_port: int, max_body_bytes: int) -> None:
        self.client, self.serving_port, self.max_body_bytes = client, serving_port, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
            # Headers and the target as the client sent them: latin-1 maps bytes to str one to
            # one (http.client encodes them back the same way); any byte is relayed, none crashes.
            target = (scope["raw_path"] + (b"?" + scope["query_string"] if scope.get("query_string") else b"")).decode("latin-1")
            # a list, not a dict: a repeated header reaches the serving process as sent (two Authorization
            # headers are refused there, whichever path the request took)
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in HOP_HEADERS]
            status, reply_headers, answer = await asyncio.get_running_loop().run_in_executor(
                None, self._forward, scope["method"], target, headers, body)
        except ApiError as exc:
            status, reply_headers, answer = exc.status, exc.headers(), exc.body()
        except (OSError, http.client.HTTPException) as exc:
            error = ApiError(503, f"the serving process is not reachable: {exc}")
            status, reply_headers, answer = error.status, error.headers(), error.body()
        except ValueError as exc:  # http.client refuses to send it (a control character, a non-ASCII path)
            error = ApiError(400, f"request cannot be relayed to the serving process: {exc}")
            status, reply_headers, answer = error.status, error.headers(), error.body()
        await send_answer(send, status, answer, reply_headers)

    def _forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.serving_port, timeout=120)
        try:
            sent_encoding = any(name.lower() == "accept-encoding" for name, _ in headers)
            conn.putrequest(method, target, skip_accept_encoding=sent_encoding)
            for name, value in headers:
                conn.putheader(name, value)
            if body or method in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            kept = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.getheaders()
                    if k.lower().encode("latin-1") not in NOT_RELAYED_BACK]
            return response.status, kept, data
        finally:
            conn.close()

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.client.connect()
                except Exception as exc:  # noqa: BLE001 -- reported to uvicorn, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                freeze_heap()  # imports done, serving process connected: later collections skip all of that
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


@dataclass
class FrontendPlan:
    """What the serving process tells its front-ends."""

    count: int
    socket_path: str
    serving_port: int
    host: str
    port: int
    max_body_bytes: int
    max_instances: int
    limits: HttpLimits
    switch_interval_us: int = 500
    caller_header: str = "x-api-key"
    priority_header: str = "x-priority"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "streamrec.serving.http.frontend",
                "--socket", self.socket_path, "--serving-port", str(self.serving_port),
                "--host", self.host, "--port", str(self.port), "--max-body-bytes", str(self.max_body_bytes),
                "--max-instances", str(self.max_instances), "--switch-interval-us", str(self.switch_interval_us),
                "--caller-header", self.caller_header, "--priority-header", self.priority_header, *self.limits.args()]


class FrontendPool:
    """Starts the front-end processes, restarts one that dies, stops them (draining) on shutdown."""

    def __init__(self, plan: FrontendPlan) -> None:
        self.plan = plan
        self.procs: list[subprocess.Popen] = []
        self.restarts = 0
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> "FrontendPool":
        env = python_env()
        self._spawn = lambda: subprocess.Popen(self.plan.command(), env=env)
        self.procs = [self._spawn() for _ in range(self.plan.count)]
        self._watch = threading.Thread(target=self._supervise, name="frontend-supervisor", daemon=True)
        self._watch.start()
        return self

    def _supervise(self) -> None:
        while not self._stopping.wait(1.0):
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and not self._stopping.is_set():
                    log.error("front-end process %d exited with %s; starting a new one", proc.pid, proc.returncode)
                    self.restarts += 1
                    self.procs[i] = self._spawn()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM: each front-end stops accepting and finishes its in-flight requests."""
        self._stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--serving-port", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--max-instances", type=int, required=True)
    parser.add_argument("--switch-interval-us", type=int, default=500)
    parser.add_argument("--caller-header", default="x-api-key")
    parser.add_argument("--priority-header", default="x-priority")
    parser.add_argument("--keep-alive-s", type=float, required=True)
    parser.add_argument("--read-timeout-s", type=float, required=True)
    parser.add_argument("--max-connections", type=int, required=True)
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval_us / 1e6)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s frontend %(process)d %(levelname)s %(message)s")
    throttle_logs()
    limits = HttpLimits(args.keep_alive_s, args.read_timeout_s, args.max_connections)
    client = ServingProcessClient(args.socket, args.max_instances)
    app = PredictShortcut(ServingRelay(client, args.serving_port, args.max_body_bytes), client.predict_body, args.max_body_bytes,
                          args.caller_header, args.priority_header)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # every front-end binds the public port
    sock.bind((args.host, args.port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, lifespan="on", proxy_headers=False,
                                           **limits.uvicorn_options()))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
