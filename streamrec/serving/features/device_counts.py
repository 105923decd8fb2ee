"""The candidates' windowed counts computed where the model runs: the items' and categories'
event-time arenas (serving/features/time_lists.py) mirrored on the device, and one kernel per batch
that counts every candidate straight into the model's counter columns and then computes the
batch's dense features.

Why: on the host, a by-ids batch gathers these counts through :class:`CounterCache` and
recomputes the hot entities whose counts moved since (serving/features/segment_counts.py): a few dozen
numpy calls per batch on the serving process's one thread, the largest share of its time on a GPU
host under load (bench/RESULTS.md, "Predict by ids"). On the device the whole batch's binary
searches are one launch, with no cache to keep.

The mirror copies only what changed: :class:`TimeLists` records the slots each one-slot
update touched (``TimeLists.follow``), whose live values and bounds are copied; new slots
copy the bounds only; every other change (a snapshot load, a compaction, a change record
grown past its bound) bumps the arena's ``generation``, after which the whole arena is
copied. :meth:`DeviceCounts.sync` runs under the feature store's lock as a batch is
assembled; the batch's kernel runs later, on the stream the model runs on, so with several
batch workers it may count a sync that came after its own (newer state, never torn). The
copies and kernels are ordered by one CUDA event chain, whatever stream each runs on, so no
kernel reads an arena a copy is writing.

On CPU (or without Triton) the same searches run as torch ops: slower than the host cache
there, so ``serving.candidate_counts = "auto"`` uses the device only on CUDA; "device"
forces this path anywhere (tests run it on CPU).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from streamrec.contracts.feature_spec import COUNTED_EVENTS, COUNTER_ENTITIES
from streamrec.embedding.kernels import available as device_kernels
from streamrec.model.batch import CTR_PRIOR_IMPS, dense_features
from streamrec.serving.features.segment_counts import segment_searchsorted
from streamrec.serving.features.time_lists import TimeLists, segment_index

try:  # Triton ships with CUDA builds of torch; CPU-only installs simply lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

KINDS = ("item", "category")  # the candidates' counted entities, in the kernel's order
CANDIDATE_COLUMNS = (*KINDS, "ts")  # the sections of a batch's copy after its counter columns
SEARCH_STEPS = 32  # halvings of a binary search: enough for any int32 list length
BLOCK = 128


class DeviceLists:
    """One :class:`TimeLists` on a device: ``values`` int64 [>= used], ``start`` int64 and
    ``length`` int32 [slots]; equal to the host's after :meth:`sync`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values = torch.zeros(1, dtype=torch.int64, device=device)
        self.start = torch.zeros(1, dtype=torch.int64, device=device)
        self.length = torch.zeros(1, dtype=torch.int32, device=device)
        self._source: TimeLists | None = None
        self._generation = -1
        self.full_copies = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.start, self.length))

    def kernel_args(self) -> tuple:
        return self.values, self.start, self.length, len(self.values)

    def current(self, lists: TimeLists) -> bool:
        """Whether the device copy equals ``lists`` already (nothing to copy)."""
        return (lists is self._source and lists.generation == self._generation and lists.changes is not None
                and not lists.changes.slots and len(lists.start) == len(self.start))

    def sync(self, lists: TimeLists) -> None:
        """Bring the device copy up to ``lists`` (the caller holds the store's lock): the live
        values and bounds of the slots updated since, or everything after a change beyond
        one slot's."""
        if lists is not self._source or lists.generation != self._generation or lists.changes is None:
            self._copy_all(lists)
            return
        if lists.used > len(self.values):  # the arena grew at its end: more room, on the device
            grown = torch.zeros(_room(lists.used), dtype=torch.int64, device=self.device)
            grown[: len(self.values)] = self.values
            self.values = grown
        if len(lists.start) != len(self.start):  # new (empty) slots: their bounds
            self.start, self.length = _to(lists.start, self.device), _to(lists.length, self.device)
        changes = lists.changes
        if not changes.slots:
            return
        slots = np.unique(np.asarray(changes.slots, np.int64))
        changes.slots.clear()
        starts, lengths = lists.start[slots], lists.length[slots]
        positions = segment_index(starts, lengths)[0]
        if len(positions):
            self.values[_to(positions, self.device)] = _to(lists.values[positions], self.device)
        where = _to(slots, self.device)
        self.start[where] = _to(starts, self.device)
        self.length[where] = _to(lengths, self.device)

    def _copy_all(self, lists: TimeLists) -> None:
        used = max(lists.used, 1)
        self.values = torch.zeros(_room(used), dtype=torch.int64, device=self.device)
        self.values[:used] = _to(lists.values[:used], self.device)
        self.start, self.length = _to(lists.start, self.device), _to(lists.length, self.device)
        self._source, self._generation = lists, lists.generation
        lists.follow()
        self.full_copies += 1


class DeviceCounts:
    """The item and category counts of a batch's candidates on ``device``, from mirrors of
    the store's arenas (:class:`serving.features.entity_store.EntityStore`)."""

    def __init__(self, device: torch.device, windows_ms: tuple[int, ...]) -> None:
        self.device = device
        self.windows = torch.tensor(windows_ms, dtype=torch.int64, device=device)
        self.lists = {(kind, counted): DeviceLists(device) for kind in KINDS for counted in COUNTED_EVENTS}
        self._lock = threading.Lock()
        self._last = torch.cuda.Event() if device.type == "cuda" else None  # the last copy or kernel on a mirror
        self.batches = 0  # batches counted here

    @property
    def nbytes(self) -> int:
        return sum(lists.nbytes for lists in self.lists.values())

    def warm_up(self) -> "DeviceCounts":
        """Compile the kernel now (a node's start), not in the first by-ids batch."""
        if device_kernels(self.device):
            width = 6 * len(self.windows)
            self.dense(np.zeros((2, width), np.int64), 1, {"item": np.zeros(1, np.int64), "category": np.zeros(1, np.int64),
                                                            "ts": np.zeros(1, np.int64)})
            torch.cuda.synchronize(self.device)
            self.batches = 0
        return self

    @property
    def full_copies(self) -> int:
        return sum(lists.full_copies for lists in self.lists.values())

    def sync(self, store) -> None:
        """Copy what changed in ``store``'s item and category arenas (under the store's lock)."""
        pairs = [(mirror, getattr(store.kinds[kind], counted)) for (kind, counted), mirror in self.lists.items()]
        if all(mirror.current(lists) for mirror, lists in pairs):
            return
        with self._ordered():
            for mirror, lists in pairs:
                mirror.sync(lists)

    def dense(self, host_counters: np.ndarray, first_row: int, candidates: dict[str, np.ndarray]) -> torch.Tensor:
        """The batch's dense features float32 [B, F] (``model.batch.dense_features``) on the
        device: of ``host_counters`` int64 [B, 6W] (per window, per entity: user, item,
        category; impressions then clicks), whose rows ``first_row:`` (a by-ids part:
        ``OnlineFeatures.assemble_batch`` ``candidate_slots``) get their items' and categories'
        counts here: ``candidates["item"]``, ``["category"]`` slots int64 [n] (-1: unknown,
        counts 0) and ``["ts"]`` int64 [n]. One host-to-device copy and, on CUDA, one kernel;
        call on the stream the model runs on."""
        rows, width = host_counters.shape
        n, size = len(candidates["ts"]), host_counters.size
        section, base = n, size  # offsets into the one buffer the kernel reads
        packed = torch.empty((base + 3 * section,), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        flat = packed.numpy()
        flat[:size] = host_counters.reshape(-1)
        for k, name in enumerate(CANDIDATE_COLUMNS):
            flat[base + k * section: base + k * section + n] = candidates[name]
        moved = packed.to(self.device, non_blocking=True)
        with self._ordered():
            self.batches += 1
            if device_kernels(self.device):
                dense = torch.empty((rows, width + width // 2), dtype=torch.float32, device=self.device)
                lists = [t for mirror in self.lists.values() for t in mirror.kernel_args()]
                _dense_kernel[(triton.cdiv(rows, BLOCK),)](moved, rows, first_row, base, base + section, base + 2 * section, *lists,
                                                           self.windows, dense, CTR_PRIOR_IMPS, W=len(self.windows), STEPS=SEARCH_STEPS,
                                                           BLOCK=BLOCK, COLS=triton.next_power_of_2(width),
                                                           PAIRS=triton.next_power_of_2(width // 2))
                return dense
            counters = moved[:size].view(rows, width)
            ts = moved[base + 2 * section: base + 2 * section + n]
            for kind in KINDS:
                at = base + CANDIDATE_COLUMNS.index(kind) * section
                slots = moved[at: at + n]
                for k, counted in enumerate(COUNTED_EVENTS):
                    mirror = self.lists[(kind, counted)]
                    column = 2 * COUNTER_ENTITIES.index(kind) + k
                    counters[first_row: first_row + n, column::6] = segment_counts_torch(mirror.values, mirror.start, mirror.length, slots,
                                                                                         ts, self.windows)
            return dense_features(counters)

    @contextmanager
    def _ordered(self) -> Iterator[None]:
        """Serialise the mirrors' copies and kernels across threads and streams: each waits
        for the one before, wherever it ran."""
        with self._lock:
            if self.device.type != "cuda":
                yield
                return
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._last)
            yield
            self._last.record(stream)


def _room(used: int) -> int:
    """Device room for an arena of ``used`` values: a quarter more, for the appends to come."""
    return used + used // 4


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy on ``device``, never a view of ``array`` (on CPU too: the host arrays change
    under the store's lock, the copy is read outside it)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, copy=True)


def segment_counts_torch(values: torch.Tensor, start: torch.Tensor, length: torch.Tensor, slots: torch.Tensor, ts: torch.Tensor,
                         windows: torch.Tensor) -> torch.Tensor:
    """The kernel's counts as torch ops (any device): int64 [n, W]."""
    known = slots >= 0
    safe = torch.where(known, slots, 0)
    starts = start[safe]
    lengths = torch.where(known, length[safe].to(torch.int64), 0)
    hi = segment_searchsorted(values, starts, lengths, ts)
    w = len(windows)
    lows = segment_searchsorted(values, starts.repeat_interleave(w), hi.repeat_interleave(w), (ts[:, None] - windows + 1).reshape(-1))
    return hi[:, None] - lows.view(-1, w)


if triton is not None:

    @triton.jit
    def _lower_bound_block(values_ptr, seg, n, target, valid, last, STEPS: tl.constexpr):
        """Per lane: how many of ``values[seg : seg + n]`` are < ``target`` (``segment_searchsorted``)."""
        base = tl.zeros_like(n)
        remaining = n
        for _ in range(STEPS):
            half = remaining >> 1
            probe = valid & (half > 0)
            v = tl.load(values_ptr + tl.minimum(seg + base + half - 1, last), mask=probe, other=0)
            base += tl.where(probe & (v < target), half, 0)
            remaining -= half
        tail = valid & (remaining > 0)
        v = tl.load(values_ptr + tl.minimum(seg + base, last), mask=tail, other=0)
        return base + tl.where(tail & (v < target), 1, 0)

    @triton.jit
    def _list_counts(values_ptr, start_ptr, length_ptr, size, slot, ts, rows_in, out_ptr, windows_ptr, W: tl.constexpr,
                     STEPS: tl.constexpr):
        """Per lane: the counts of one list of slot ``slot`` in each window before ``ts``, stored
        at ``out_ptr + 6 * w`` (0 for an unknown slot)."""
        known = rows_in & (slot >= 0)
        safe = tl.where(known, slot, 0)
        seg = tl.load(start_ptr + safe, mask=known, other=0)
        length = tl.load(length_ptr + safe, mask=known, other=0).to(tl.int64)
        hi = _lower_bound_block(values_ptr, seg, length, ts, known, size - 1, STEPS)
        for w in tl.static_range(W):
            window = tl.load(windows_ptr + w)
            low = _lower_bound_block(values_ptr, seg, hi, ts - window + 1, known, size - 1, STEPS)
            tl.store(out_ptr + 6 * w, hi - low, mask=rows_in)

    @triton.jit(do_not_specialize=["rows", "first_row", "item_at", "category_at", "ts_at", "z0", "z1", "z2", "z3"])
    def _dense_kernel(buf_ptr, rows, first_row, item_at, category_at, ts_at,
                      v0, s0, l0, z0, v1, s1, l1, z1, v2, s2, l2, z2, v3, s3, l3, z3,
                      windows_ptr, dense_ptr, prior, W: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                      COLS: tl.constexpr, PAIRS: tl.constexpr):
        """A block of rows: the by-ids rows' item and category counts into the counter columns
        (in ``buf``), then every row's dense features: log1p of each column, and per
        (window, entity) clicks / (impressions + CTR_PRIOR_IMPS)."""
        width = 6 * W
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = r < rows
        cand = valid & (r >= first_row)
        j = tl.where(cand, r - first_row, 0)
        ts = tl.load(buf_ptr + ts_at + j, mask=cand, other=0)
        item = tl.load(buf_ptr + item_at + j, mask=cand, other=-1)
        category = tl.load(buf_ptr + category_at + j, mask=cand, other=-1)
        row = buf_ptr + r * width
        _list_counts(v0, s0, l0, z0, item, ts, cand, row + 2, windows_ptr, W, STEPS)
        _list_counts(v1, s1, l1, z1, item, ts, cand, row + 3, windows_ptr, W, STEPS)
        _list_counts(v2, s2, l2, z2, category, ts, cand, row + 4, windows_ptr, W, STEPS)
        _list_counts(v3, s3, l3, z3, category, ts, cand, row + 5, windows_ptr, W, STEPS)
        tl.debug_barrier()  # this block's counts are written: every thread of it reads them below
        features = width + width // 2
        cols = tl.arange(0, COLS)
        inside = valid[:, None] & (cols < width)[None, :]
        counts = tl.load(buf_ptr + r[:, None] * width + cols[None, :], mask=inside, other=0).to(tl.float32)
        tl.store(dense_ptr + r[:, None] * features + cols[None, :], tl.log(1.0 + counts), mask=inside)
        pairs = tl.arange(0, PAIRS)
        paired = valid[:, None] & (pairs < width // 2)[None, :]
        at = buf_ptr + r[:, None] * width + 2 * pairs[None, :]
        imps = tl.load(at, mask=paired, other=0).to(tl.float32)
        clicks = tl.load(at + 1, mask=paired, other=0).to(tl.float32)
        tl.store(dense_ptr + r[:, None] * features + width + pairs[None, :], clicks / (imps + prior), mask=paired)
