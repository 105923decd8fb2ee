"""The candidates' windowed counts computed where the model runs: the items' and categories'
event-time arenas (serving/time_lists.py) mirrored on the device, and one kernel per kind
that counts every candidate of a batch straight into the model's counter columns.

Why: on the host, a by-ids batch gathers these counts through :class:`CounterCache` and
recomputes the hot entities whose counts moved since (serving/segment_counts.py): a few dozen
numpy calls per batch, which on a GPU host's slower cores was about a third of the engine
thread's time under load (bench/RESULTS.md, "Predict by ids"). On the device the whole
batch's binary searches are one launch per kind, with no cache to keep.

The mirror copies only what changed: :class:`TimeLists` records the slots and value ranges
each one-slot update wrote (``TimeLists.follow``), and every other change (a snapshot load,
a compaction, new slots) bumps its ``generation``, after which the whole arena is copied.
:meth:`DeviceCounts.sync` runs under the feature store's lock; the copies and the kernels are
ordered by one CUDA event chain, whatever stream each runs on, so a batch worker's kernel
never reads an arena another worker's sync is writing.

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

from streamrec.model.batch import CTR_PRIOR_IMPS, dense_features
from streamrec.serving.time_lists import TimeLists, segment_index

try:  # Triton ships with CUDA builds of torch; CPU-only installs simply lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

COUNTED = ("imps", "clicks")
SEARCH_STEPS = 32  # halvings of a binary search: enough for any int32 list length
BLOCK = 128


def device_kernels(device: torch.device) -> bool:
    """Whether ``device`` runs the counting kernel (CUDA with Triton), where it beats the host."""
    return triton is not None and device.type == "cuda"


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
        return lists is self._source and lists.generation == self._generation and lists.changes is not None and not lists.changes.slots

    def sync(self, lists: TimeLists) -> None:
        """Bring the device copy up to ``lists`` (the caller holds the store's lock)."""
        if lists is not self._source or lists.generation != self._generation or lists.changes is None:
            self._copy_all(lists)
            return
        changes = lists.changes
        if not changes.slots:
            return
        if lists.used > len(self.values):
            self._copy_all(lists)
            return
        slots = np.unique(np.asarray(changes.slots, np.int64))
        ranges = np.asarray(changes.ranges, np.int64).reshape(-1, 2)
        changes.slots.clear()
        changes.ranges.clear()
        positions = segment_index(ranges[:, 0], ranges[:, 1] - ranges[:, 0])[0] if len(ranges) else np.zeros(0, np.int64)
        if len(positions):
            self.values[_to(positions, self.device)] = _to(lists.values[positions], self.device)
        where = _to(slots, self.device)
        self.start[where] = _to(lists.start[slots], self.device)
        self.length[where] = _to(lists.length[slots], self.device)

    def _copy_all(self, lists: TimeLists) -> None:
        used = max(lists.used, 1)
        room = used + used // 4  # appends land at the arena's end: room for them before the next full copy
        self.values = torch.zeros(room, dtype=torch.int64, device=self.device)
        self.values[:used] = _to(lists.values[:used], self.device)
        self.start = _to(lists.start, self.device)
        self.length = _to(lists.length, self.device)
        self._source, self._generation = lists, lists.generation
        lists.follow()
        self.full_copies += 1


class DeviceCounts:
    """The item and category counts of a batch's candidates on ``device``, from mirrors of
    the store's arenas (:class:`serving.entity_store.EntityStore`)."""

    def __init__(self, device: torch.device, windows_ms: tuple[int, ...], kinds: tuple[str, ...] = ("item", "category")) -> None:
        self.device, self.kinds = device, kinds
        self.windows = torch.tensor(windows_ms, dtype=torch.int64, device=device)
        self.lists = {(kind, counted): DeviceLists(device) for kind in kinds for counted in COUNTED}
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
        section = -(-n // 2) * 2  # 16-byte aligned sections: the kernel is compiled for aligned pointers only
        base = -(-size // 2) * 2
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
                lists = [t for kind in self.kinds for counted in COUNTED for t in self.lists[(kind, counted)].kernel_args()]
                _dense_kernel[(triton.cdiv(rows, BLOCK),)](moved, rows, first_row, base, base + section, base + 2 * section, *lists,
                                                           self.windows, dense, CTR_PRIOR_IMPS, W=len(self.windows), STEPS=SEARCH_STEPS,
                                                           BLOCK=BLOCK, COLS=triton.next_power_of_2(width),
                                                           PAIRS=triton.next_power_of_2(width // 2))
                return dense
            counters = moved[:size].view(rows, width)
            ts = moved[base + 2 * section: base + 2 * section + n]
            for kind in self.kinds:
                slots = moved[base + KINDS_AT[kind] * section: base + KINDS_AT[kind] * section + n]
                for k, counted in enumerate(COUNTED):
                    mirror = self.lists[(kind, counted)]
                    column = 2 * ENTITY_INDEX[kind] + k
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


ENTITY_INDEX = {"user": 0, "item": 1, "category": 2}  # the counter columns' entity order (COUNTER_ENTITIES)
CANDIDATE_COLUMNS = ("item", "category", "ts")  # the sections of a batch's copy after its counters
KINDS_AT = {"item": 0, "category": 1}


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def segment_counts_torch(values: torch.Tensor, start: torch.Tensor, length: torch.Tensor, slots: torch.Tensor, ts: torch.Tensor,
                         windows: torch.Tensor) -> torch.Tensor:
    """The same counts as torch ops (any device): int64 [n, W]."""
    known = slots >= 0
    safe = torch.where(known, slots, 0)
    starts = start[safe]
    lengths = torch.where(known, length[safe].to(torch.int64), 0)
    hi = _lower_bound(values, starts, lengths, ts)
    w = len(windows)
    lows = _lower_bound(values, starts.repeat_interleave(w), hi.repeat_interleave(w), (ts[:, None] - windows + 1).reshape(-1))
    return hi[:, None] - lows.view(-1, w)


def _lower_bound(values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per query, how many of ``values[starts : starts + lengths]`` (ascending) are < target:
    branch-free halving, as serving/segment_counts.py's ``segment_searchsorted``."""
    base = torch.zeros_like(targets)
    remaining = lengths.clone()
    last = len(values) - 1
    while True:
        half = remaining >> 1
        if not bool(half.any()):
            break
        below = values[torch.clamp(starts + base + half - 1, max=last)] < targets
        base += torch.where(below, half, 0)
        remaining -= half
    return base + ((remaining > 0) & (values[torch.clamp(starts + base, max=last)] < targets)).to(torch.int64)


if triton is not None:

    @triton.jit
    def _lower_bound_block(values_ptr, seg, n, target, valid, last, STEPS: tl.constexpr):
        """Per lane: how many of ``values[seg : seg + n]`` are < ``target``."""
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
