"""The model runner: shape buckets compiled ahead of serving, one execution context per worker.

A batch of B instances whose longest behaviour sequence has length n runs in the smallest
ready bucket (b, l) with b >= B and l >= n: its inputs are padded to (b, l) and the
bucket's compiled forward runs. Buckets are built when the model is loaded (before it
serves), so no request waits for a compile. A batch larger than every bucket runs
eagerly at once, and a bucket for it (the next power of two) is built in the
background and used from then on — at most ``max_extra`` such buckets.

Modes (``serving.compile``):
- ``eager``: no buckets; the model runs on each batch as is (the trainer's path);
- ``compile``: ``torch.compile`` per bucket shape (static shapes, any device);
- ``graph``: a CUDA graph per bucket per worker (CUDA only) over the eager model;
- ``compile+graph``: CUDA graphs over the compiled model (CUDA only);
- ``auto``: ``graph`` on CUDA, ``eager`` on CPU (see docs/serving.md for the measurements).

Each worker (``serving.workers``) owns a context: on CUDA a stream of its own and its own
graphs with their static input buffers, so workers run batches concurrently. Dense weights
are read in place: a delta copied into the parameters is seen by every graph.

Padding is exact: padded history positions are masked (their attention weight is 0)
and padded rows are dropped, so a bucket's scores equal the eager model's up to
floating-point reassociation (measured and tested bounds: docs/serving.md, "Shape buckets").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from streamrec.model.network import N_FIELDS, CTRModel
from streamrec.model.sparse import ModelInputs
from streamrec.plumbing.config import ServingConfig, check_serving_mode, parse_sizes

log = logging.getLogger("streamrec.serving")


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    history: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.history}"


@dataclass(frozen=True)
class RuntimeConfig:
    """How the served model runs; from the [serving] config section (:meth:`from_serving`)."""

    mode: str
    batch_buckets: tuple[int, ...]
    history_buckets: tuple[int, ...]
    max_extra: int  # buckets built for out-of-bucket batches, at most
    workers: int

    @classmethod
    def from_serving(cls, s: ServingConfig) -> "RuntimeConfig":
        return cls(s.compile, parse_sizes(s.batch_buckets, "serving.batch_buckets"),
                   parse_sizes(s.history_buckets, "serving.history_buckets"), s.max_extra_buckets,
                   max(1, s.batch_workers("cuda")))  # execution contexts: one for "auto", on any device

    def resolved_mode(self, device: torch.device) -> str:
        check_serving_mode(self.mode)
        if self.mode == "auto":
            return "graph" if device.type == "cuda" else "eager"
        if "graph" in self.mode and device.type != "cuda":
            raise ValueError(f"serving.compile={self.mode!r} needs CUDA (device is {device}); use 'compile' or 'eager' on CPU")
        return self.mode


@dataclass
class BucketStats:
    batches: int = 0
    rows: int = 0
    padded_rows: int = 0
    device_s: float = 0.0  # forward time on the device (CUDA events; wall time on CPU)
    build_s: float = 0.0
    memory_bytes: int = 0  # CUDA memory the bucket's graphs hold (all workers)
    origin: str = "load"  # "load" or "async" (built for an out-of-bucket batch)


@dataclass
class RunnerStats:
    mode: str
    buckets: dict[Bucket, BucketStats] = field(default_factory=dict)
    eager_batches: int = 0  # out-of-bucket batches (and every batch in eager mode)
    eager_device_s: float = 0.0
    pending: set[Bucket] = field(default_factory=set)
    refused: int = 0  # out-of-bucket batches after max_extra buckets were built

    def as_json(self) -> dict:
        return {
            "mode": self.mode,
            "compiled_buckets": len(self.buckets),
            "build_s": round(sum(b.build_s for b in self.buckets.values()), 3),
            "memory_bytes": sum(b.memory_bytes for b in self.buckets.values()),
            "eager_batches": self.eager_batches,
            "eager_device_ms_per_batch": round(1000 * self.eager_device_s / self.eager_batches, 3) if self.eager_batches else None,
            "pending": sorted(str(b) for b in self.pending),
            "beyond_max_extra": self.refused,
            "buckets": {str(b): {"batches": s.batches, "rows": s.rows, "padded_rows": s.padded_rows, "origin": s.origin,
                                 "device_ms_per_batch": round(1000 * s.device_s / s.batches, 3) if s.batches else None,
                                 "build_s": round(s.build_s, 3), "memory_bytes": s.memory_bytes}
                        for b, s in sorted(self.buckets.items())},
        }


class _Graph:
    """One bucket captured on one worker's stream: static inputs in, static scores out."""

    def __init__(self, forward: Callable, bucket: Bucket, template: ModelInputs, stream: torch.cuda.Stream) -> None:
        b, l = bucket.batch, bucket.history
        fields, history, _, dense = template.as_args()
        device = fields.device
        self.fields = torch.zeros(b, *fields.shape[1:], device=device, dtype=fields.dtype)
        self.history = torch.zeros(b, l, history.shape[2], device=device, dtype=history.dtype)
        self.mask = torch.zeros(b, l, device=device, dtype=torch.bool)
        self.dense = torch.zeros(b, dense.shape[1], device=device, dtype=dense.dtype)
        args = (self.fields, self.history, self.mask, self.dense)
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture (cuBLAS handles, compiled kernels, allocator)
                forward(*args)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.scores = forward(*args)

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        n, l = inputs.fields.shape[0], inputs.history.shape[1]
        self.fields[:n].copy_(inputs.fields)
        self.history[:n, :l].copy_(inputs.history)
        self.mask[:n, :l].copy_(inputs.history_mask)
        self.mask[:n, l:].fill_(False)
        self.dense[:n].copy_(inputs.dense)
        self.graph.replay()
        return self.scores[:n]


@dataclass
class Worker:
    """One worker's execution context: its stream (CUDA) and its captured buckets."""

    index: int
    stream: torch.cuda.Stream | None
    graphs: dict[Bucket, _Graph] = field(default_factory=dict)

    @contextmanager
    def on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield


def _pad(t: torch.Tensor, rows: int, length: int | None = None) -> torch.Tensor:
    """``t`` zero-padded to ``rows`` rows (and, for sequences, ``length`` positions)."""
    shape = list(t.shape)
    shape[0] = rows
    if length is not None:
        shape[1] = length
    out = t.new_zeros(shape)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


class ModelRunner:
    """Runs the dense model of one loaded version on batches, in buckets."""

    def __init__(self, model: CTRModel, config: RuntimeConfig, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.config = config
        self.mode = config.resolved_mode(device)
        self.history_len = model.spec.history_len
        self.stats = RunnerStats(self.mode)
        self._compiled: Callable | None = None
        self._shapes = (len(config.batch_buckets) + 1) * (len(config.history_buckets) + 1) + config.max_extra
        if "compile" in self.mode:
            # the module, not a closure over it: a later version's model (same class and
            # shapes) then reuses the compiled code instead of compiling again
            compiled_model = torch.compile(model, dynamic=False)
            self._compiled = lambda *args: torch.sigmoid(compiled_model(*args))
        self._lock = threading.Lock()
        self._workers: queue.SimpleQueue[Worker] = queue.SimpleQueue()
        self._all_workers = [Worker(i, torch.cuda.Stream(device) if device.type == "cuda" else None) for i in range(max(1, config.workers))]
        for w in self._all_workers:
            self._workers.put(w)
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucket-builder")
        self.ready: set[Bucket] = set()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the weights were written on this thread's stream
        if self.mode != "eager":
            histories = sorted({min(h, self.history_len) for h in config.history_buckets} | {self.history_len})
            for b in config.batch_buckets:
                for h in histories:
                    self._build(Bucket(b, h), "load")

    # ------------------------------------------------------------------ running
    def history_bucket(self, longest: int) -> int:
        """The sequence length a batch whose longest history is ``longest`` runs at."""
        if self.mode == "eager":
            return self.history_len
        lengths = sorted({b.history for b in self.ready}) or [self.history_len]
        return next((h for h in lengths if h >= longest), self.history_len)

    @contextmanager
    def worker(self) -> Iterator[Worker]:
        """Check out a worker context for one batch (lookups and forward run on its stream)."""
        w = self._workers.get()
        try:
            with w.on_stream():
                yield w
        finally:
            self._workers.put(w)

    def run(self, w: Worker, inputs: ModelInputs) -> torch.Tensor:
        """Scores [B] of one batch (on the device, not yet synchronised)."""
        n, length = inputs.fields.shape[0], inputs.history.shape[1]
        bucket = self._pick(n, length)
        timer = _Timer(w.stream)
        if bucket is None:
            out = self._scores(*inputs.as_args())
            with self._lock:
                self.stats.eager_batches += 1
                self.stats.eager_device_s += timer.elapsed(out)
            return out
        if w.stream is not None and bucket in w.graphs:
            out = w.graphs[bucket].run(inputs)
        else:
            args = (_pad(inputs.fields, bucket.batch), _pad(inputs.history, bucket.batch, bucket.history),
                    _pad(inputs.history_mask, bucket.batch, bucket.history), _pad(inputs.dense, bucket.batch))
            out = self._compiled(*args)[:n]
        s = self.stats.buckets[bucket]
        elapsed = timer.elapsed(out)
        with self._lock:
            s.batches += 1
            s.rows += n
            s.padded_rows += bucket.batch - n
            s.device_s += elapsed
        return out

    def _scores(self, fields: torch.Tensor, history: torch.Tensor, mask: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(fields, history, mask, dense))

    def _pick(self, n: int, length: int) -> Bucket | None:
        if self.mode == "eager":
            return None
        fits = [b for b in self.ready if b.batch >= n and b.history >= length]
        if fits:
            return min(fits, key=lambda b: (b.batch * b.history, b.batch))
        self._build_later(n, length)
        return None

    # ------------------------------------------------------------------ building buckets
    def _build_later(self, n: int, length: int) -> None:
        bucket = Bucket(1 << (n - 1).bit_length(), length if length in {b.history for b in self.ready} else self.history_len)
        with self._lock:
            extra = sum(1 for s in self.stats.buckets.values() if s.origin == "async") + len(self.stats.pending)
            if bucket in self.stats.pending or bucket in self.ready:
                return
            if extra >= self.config.max_extra:
                self.stats.refused += 1
                if self.stats.refused == 1:
                    log.warning("batch of %d rows fits no bucket and serving.max_extra_buckets (%d) are built: it runs eagerly",
                                n, self.config.max_extra)
                return
            self.stats.pending.add(bucket)
        log.info("batch of %d rows fits no bucket: answered eagerly, building bucket %s in the background", n, bucket)
        self._builder.submit(self._build_in_background, bucket)

    def _build_in_background(self, bucket: Bucket) -> None:
        """Batches keep running meanwhile: captures use the (checked-out) worker streams in
        thread-local capture mode, and a version applied meanwhile changes the weights in
        place, which the graph reads at replay, not at capture."""
        try:
            self._build(bucket, "async")
        except Exception:
            log.exception("building bucket %s failed; batches of that shape keep running eagerly", bucket)
        finally:
            with self._lock:
                self.stats.pending.discard(bucket)

    def _build(self, bucket: Bucket, origin: str) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        example = self._example(bucket)
        forward = self._compiled if self._compiled is not None else self._scores
        graphs: dict[int, _Graph] = {}
        if self._compiled is not None:
            _allow_recompiles(self._shapes)  # dynamo's limits are per thread: set them on the building one
        with torch.no_grad():
            if "graph" in self.mode:
                # capture on each worker's stream while holding that worker, so no batch of
                # it is enqueued on the stream in the middle of the capture
                while len(graphs) < len(self._all_workers):
                    w = self._workers.get()
                    try:
                        if w.index not in graphs:
                            graphs[w.index] = _Graph(forward, bucket, example, w.stream)
                            w.stream.synchronize()
                    finally:
                        self._workers.put(w)
            else:
                forward(*example.as_args())  # compiles this shape now
        memory = torch.cuda.memory_allocated(self.device) - before if self.device.type == "cuda" else 0
        with self._lock:
            for w in self._all_workers:
                if w.index in graphs:
                    w.graphs[bucket] = graphs[w.index]
            self.stats.buckets[bucket] = BucketStats(build_s=time.perf_counter() - t0, memory_bytes=max(memory, 0), origin=origin)
            self.ready = self.ready | {bucket}  # readers see the old or the new set, never a half-built one
        log.debug("bucket %s built in %.2f s (%s)", bucket, time.perf_counter() - t0, self.mode)

    def _example(self, bucket: Bucket) -> ModelInputs:
        spec, b, l = self.model.spec, bucket.batch, bucket.history
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, device=self.device, dtype=dtype)  # noqa: E731
        return ModelInputs(zeros(b, N_FIELDS, spec.embedding_dim), zeros(b, l, 2 * spec.embedding_dim), zeros(b, l, dtype=torch.bool),
                           zeros(b, spec.n_dense))

    def close(self) -> None:
        self._builder.shutdown(wait=True, cancel_futures=True)


class _Timer:
    """Forward time of one batch: CUDA events on the worker's stream, wall time on CPU."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        if stream is not None:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record(stream)
        else:
            self.t0 = time.perf_counter()

    def elapsed(self, out: torch.Tensor) -> float:
        if self.stream is None:
            return time.perf_counter() - self.t0
        self.end.record(self.stream)
        self.end.synchronize()  # the caller copies the scores to the host right after: no extra wait
        return self.start.elapsed_time(self.end) / 1000


def _allow_recompiles(n: int) -> None:
    """torch.compile falls back to eager after ``recompile_limit`` shapes of one function;
    every bucket is one shape, so raise the limit (of the calling thread: dynamo's config
    is thread-local) to cover them."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), n + 8))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * (n + 8))
