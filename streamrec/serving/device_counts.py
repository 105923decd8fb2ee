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
        self._last: torch.cuda.Event | None = None
        self.batches = 0  # batches counted here

    @property
    def nbytes(self) -> int:
        return sum(lists.nbytes for lists in self.lists.values())

    def warm_up(self) -> "DeviceCounts":
        """Compile the kernel now (a node's start), not in the first by-ids batch."""
        if device_kernels(self.device):
            one = torch.zeros(1, dtype=torch.int64, device=self.device)
            _segment_counts(DeviceLists(self.device), one, one, self.windows, torch.zeros((1, 6 * len(self.windows)), dtype=torch.int64,
                                                                                         device=self.device), 0, 0)
            torch.cuda.synchronize(self.device)
        return self

    @property
    def full_copies(self) -> int:
        return sum(lists.full_copies for lists in self.lists.values())

    def sync(self, store) -> None:
        """Copy what changed in ``store``'s item and category arenas (under the store's lock)."""
        with self._ordered():
            for (kind, counted), mirror in self.lists.items():
                mirror.sync(getattr(store.kinds[kind], counted))

    def fill(self, counters: torch.Tensor, first_row: int, slots: dict[str, torch.Tensor], ts: torch.Tensor, entity_index: dict[str, int]) -> None:
        """Write the counts of ``slots[kind]`` (int64 [n], -1: unknown, counts 0) at ``ts``
        (int64 [n]) into ``counters`` (int64 [B, 6W] on the device: per window, per entity
        (user, item, category), imps then clicks) rows ``first_row:first_row + n``, columns of
        ``entity_index[kind]``."""
        n = len(ts)
        if not n:
            return
        with self._ordered():
            self.batches += 1
            for kind in self.kinds:
                for k, counted in enumerate(COUNTED):
                    _segment_counts(self.lists[(kind, counted)], slots[kind], ts, self.windows, counters, first_row, 2 * entity_index[kind] + k)

    @contextmanager
    def _ordered(self) -> Iterator[None]:
        """Serialise the mirrors' copies and kernels across threads and streams."""
        with self._lock:
            if self.device.type != "cuda":
                yield
                return
            stream = torch.cuda.current_stream(self.device)
            if self._last is not None:
                stream.wait_event(self._last)
            yield
            self._last = torch.cuda.Event()
            self._last.record(stream)


ENTITY_INDEX = {"user": 0, "item": 1, "category": 2}  # the counter columns' entity order (COUNTER_ENTITIES)


def counters_on_device(counts: DeviceCounts, host_counters: np.ndarray, first_row: int, candidates: dict[str, np.ndarray]) -> torch.Tensor:
    """The batch's counter columns int64 [B, 6W] on ``counts.device``: ``host_counters`` with
    rows ``first_row:`` (a by-ids part, ``OnlineFeatures.assemble_batch`` ``candidate_slots``)
    completed by :meth:`DeviceCounts.fill`. One host-to-device copy for the columns, the
    slots and the times; call on the stream the model runs on."""
    n, size = len(candidates["ts"]), host_counters.size
    section = -(-n // 2) * 2  # 16-byte aligned sections: the kernel is compiled for aligned pointers only
    base = -(-size // 2) * 2
    packed = torch.empty((base + 3 * section,), dtype=torch.int64, pin_memory=counts.device.type == "cuda")
    flat = packed.numpy()
    flat[:size] = host_counters.reshape(-1)
    for k, name in enumerate(("item", "category", "ts")):
        flat[base + k * section: base + k * section + n] = candidates[name]
    moved = packed.to(counts.device, non_blocking=True)
    counters = moved[:size].view(host_counters.shape)
    slots = {"item": moved[base: base + n], "category": moved[base + section: base + section + n]}
    counts.fill(counters, first_row, slots, moved[base + 2 * section: base + 2 * section + n], ENTITY_INDEX)
    return counters


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _segment_counts(mirror: DeviceLists, slots: torch.Tensor, ts: torch.Tensor, windows: torch.Tensor, counters: torch.Tensor,
                    first_row: int, column: int) -> None:
    """``counters[first_row + i, column + 6 * w]`` = how many of slot ``slots[i]``'s times lie in
    ``(ts[i] - windows[w], ts[i])``; ``counters`` int64 [B, 6W], contiguous."""
    n, w = len(ts), len(windows)
    if device_kernels(counters.device):
        _counts_kernel[(triton.cdiv(n, BLOCK),)](mirror.values, mirror.start, mirror.length, slots, ts, windows, counters, first_row,
                                                 column, n, counters.stride(0), len(mirror.values), W=w, STEPS=SEARCH_STEPS, BLOCK=BLOCK)
        return
    counters[first_row: first_row + n, column::6] = segment_counts_torch(mirror.values, mirror.start, mirror.length, slots, ts, windows)


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

    @triton.jit(do_not_specialize=["first_row", "column", "n", "size"])
    def _counts_kernel(values_ptr, start_ptr, length_ptr, slots_ptr, ts_ptr, windows_ptr, out_ptr, first_row, column, n, stride_row, size,
                       W: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        slot = tl.load(slots_ptr + offs, mask=valid, other=-1)
        known = valid & (slot >= 0)
        safe = tl.where(known, slot, 0)
        seg = tl.load(start_ptr + safe, mask=known, other=0)
        length = tl.load(length_ptr + safe, mask=known, other=0).to(tl.int64)
        ts = tl.load(ts_ptr + offs, mask=valid, other=0)
        last = size - 1
        hi = _lower_bound_block(values_ptr, seg, length, ts, known, last, STEPS)
        for w in tl.static_range(W):
            window = tl.load(windows_ptr + w)
            low = _lower_bound_block(values_ptr, seg, hi, ts - window + 1, known, last, STEPS)
            tl.store(out_ptr + (first_row + offs) * stride_row + column + 6 * w, hi - low, mask=valid)
