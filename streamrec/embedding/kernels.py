"""Triton kernels of the GPU tiers: the fused cache-hit path (hash probe + row gather in one
launch, for one table or table-batched), probe / insert / removal of a hash index,
find-or-insert (rows created on the device), and row copies between tiers (a mapped DRAM
tier included: misses up, evictions down).

Why the fused hit path: in torch it is unique + several probe rounds (each a few kernels and a
host sync) + gathers; for a 64k-id batch that is milliseconds of launch overhead around
microseconds of memory traffic. This Triton kernel probes the cache's hash index and
copies the row for every id in one pass, so the hit path costs about what a plain
``index_select`` of the same rows costs (bench/RESULTS.md).

Used only on CUDA with Triton installed; everything else takes the torch path.
"""

from __future__ import annotations

from typing import Protocol

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs simply lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

from streamrec.embedding.hash_layout import EMPTY, MULTIPLIER, TOMBSTONE

MAX_PROBES = 64  # linear probes per id at load <= 0.5; ids needing more fall back to torch
# a grouped find-or-insert's row per table: key start, key count, first block, index bits,
# seed, then the tier's index keys, index values, fresh slots, weights, state, clock, keys, live, dirty
FIND_OR_INSERT_FIELDS = 14
# a grouped probe + gather's row per table: id start, id count, first block, index bits, pending
# bound (-1: ids not hit are pending, -2: only undecided ones), then the tier's index keys,
# index values, weights, clock
PROBE_GATHER_FIELDS = 9


class SlotTables(Protocol):
    """An index as a kernel sees it: 2**bits slots of (key, value), linear probing from
    ``(key * MULTIPLIER) >> (64 - bits)``."""

    @property
    def bits(self) -> int: ...

    def raw_tables(self) -> tuple[torch.Tensor, torch.Tensor]: ...


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _probe_block(key, valid, index_keys_ptr, index_values_ptr, multiplier, shift, mask, empty, tombstone,
                     BLOCK: tl.constexpr, PROBES: tl.constexpr, REMOVE: tl.constexpr):
        """Slots of one block of keys in an index: -1 absent, -2 undecided after PROBES."""
        pos = ((key * multiplier) >> shift) & mask
        slot = tl.full((BLOCK,), -1, tl.int64)
        searching = valid
        for _ in range(PROBES):
            found = tl.load(index_keys_ptr + pos, mask=searching, other=empty)
            hit = searching & (found == key)
            value = tl.load(index_values_ptr + pos, mask=hit, other=-1)
            slot = tl.where(hit, value, slot)
            if REMOVE:  # keys are unique in the batch: only this lane owns its key's slot
                tl.store(index_keys_ptr + pos, tombstone + tl.zeros((BLOCK,), tl.int64), mask=hit)
                tl.store(index_values_ptr + pos, tl.full((BLOCK,), -1, tl.int64), mask=hit)
            searching = searching & (found != key) & (found != empty)
            pos = (pos + 1) & mask
        return tl.where(searching, -2, slot)  # -2: gave up probing, let torch decide

    @triton.jit
    def _hit_rows(slot, valid, offs, weights_ptr, out_ptr, last_seen_ptr, now, DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr, UPDATE_CLOCK: tl.constexpr, GATHER: tl.constexpr):
        """The LRU clock of the rows hit (``slot >= 0``) and every lane's row into ``out`` (zeros where no hit)."""
        is_hit = slot >= 0
        if UPDATE_CLOCK:
            tl.store(last_seen_ptr + tl.where(is_hit, slot, 0), now + tl.zeros((BLOCK,), tl.int64), mask=is_hit)
        if GATHER:
            cols = tl.arange(0, DIM_BLOCK)
            col_ok = cols < DIM
            have = is_hit[:, None] & col_ok[None, :]
            rows = tl.load(weights_ptr + tl.where(is_hit, slot, 0)[:, None] * DIM + cols[None, :], mask=have, other=0.0)
            tl.store(out_ptr + offs[:, None] * DIM + cols[None, :], rows, mask=valid[:, None] & col_ok[None, :])

    # Integer arguments are not specialised on their values: Triton would otherwise compile
    # a new variant whenever n or the clock changes divisibility by 16 (seconds each, mid-training).
    @triton.jit(do_not_specialize=["now", "n", "multiplier", "shift", "mask", "empty", "tombstone"])
    def _probe_gather(ids_ptr, index_keys_ptr, index_values_ptr, weights_ptr, out_ptr, slots_ptr,
                      last_seen_ptr, misses_ptr, now, n, multiplier, shift, mask, empty, tombstone,
                      DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr,
                      UPDATE_CLOCK: tl.constexpr, COUNT_MISSES: tl.constexpr, GATHER: tl.constexpr,
                      REMOVE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        key = tl.load(ids_ptr + offs, mask=valid, other=0)
        slot = _probe_block(key, valid, index_keys_ptr, index_values_ptr, multiplier, shift, mask, empty, tombstone,
                            BLOCK, PROBES, REMOVE)
        tl.store(slots_ptr + offs, slot, mask=valid)
        # LRU clock of the rows hit, and a count of ids not answered here, in the same pass
        # (saves a launch and a separate reduction before the host decides on a fallback).
        if COUNT_MISSES:
            tl.atomic_add(misses_ptr, tl.sum((valid & (slot < 0)).to(tl.int32), axis=0))
        _hit_rows(slot, valid, offs, weights_ptr, out_ptr, last_seen_ptr, now, DIM, DIM_BLOCK, BLOCK, UPDATE_CLOCK, GATHER)

    @triton.jit(do_not_specialize=["now", "multiplier", "empty", "tombstone"])
    def _probe_gather_grouped(ids_ptr, groups_ptr, out_ptr, pending_ptr, now, multiplier, empty, tombstone,
                              GROUPS: tl.constexpr, FIELDS: tl.constexpr, DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
                              BLOCK: tl.constexpr, PROBES: tl.constexpr):
        # this program's table: the last whose first block is at or before it (PROBE_GATHER_FIELDS rows)
        pid = tl.program_id(0)
        g = 0
        for j in tl.static_range(1, GROUPS):
            g += (pid >= tl.load(groups_ptr + j * FIELDS + 2)).to(tl.int32)
        row = groups_ptr + g * FIELDS
        local = (pid - tl.load(row + 2)) * BLOCK + tl.arange(0, BLOCK)
        valid = local < tl.load(row + 1)
        offs = tl.load(row) + local
        key = tl.load(ids_ptr + offs, mask=valid, other=0)
        bits = tl.load(row + 3)
        i64 = tl.pointer_type(tl.int64)
        slot = _probe_block(key, valid, tl.load(row + 5).to(i64), tl.load(row + 6).to(i64), multiplier, 64 - bits,
                            (tl.full((), 1, tl.int64) << bits) - 1, empty, tombstone, BLOCK, PROBES, False)
        tl.atomic_add(pending_ptr + g, tl.sum((valid & (slot <= tl.load(row + 4))).to(tl.int32), axis=0))
        _hit_rows(slot, valid, offs, tl.load(row + 7).to(tl.pointer_type(tl.float32)), out_ptr, tl.load(row + 8).to(i64), now,
                  DIM, DIM_BLOCK, BLOCK, True, True)


if triton is not None:

    @triton.jit(do_not_specialize=["n", "multiplier", "shift", "mask", "empty", "tombstone"])
    def _insert(keys_ptr, values_ptr, index_keys_ptr, index_values_ptr, scratch_ptr, left_ptr, n, multiplier, shift, mask,
                empty, tombstone, BLOCK: tl.constexpr, PROBES: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        key = tl.load(keys_ptr + offs, mask=valid, other=0)
        value = tl.load(values_ptr + offs, mask=valid, other=-1)
        pos = ((key * multiplier) >> shift) & mask
        pending = valid
        for _ in range(PROBES):
            # atomic_cas has no mask: lanes that are done aim at their own scratch word,
            # which never holds EMPTY or TOMBSTONE, so their CAS fails harmlessly.
            target = tl.where(pending, index_keys_ptr + pos, scratch_ptr + offs)
            old = tl.atomic_cas(target, empty + tl.zeros((BLOCK,), tl.int64), key)
            won = pending & (old == empty)
            retry_tomb = pending & (old == tombstone)
            target = tl.where(retry_tomb, index_keys_ptr + pos, scratch_ptr + offs)
            old2 = tl.atomic_cas(target, tombstone + tl.zeros((BLOCK,), tl.int64), key)
            won = won | (retry_tomb & (old2 == tombstone))
            tl.store(index_values_ptr + pos, value, mask=won)
            pending = pending & ~won
            pos = tl.where(pending, (pos + 1) & mask, pos)
        tl.store(left_ptr + offs, pending.to(tl.int8), mask=valid)


def insert(keys: torch.Tensor, values: torch.Tensor, index: SlotTables) -> torch.Tensor:
    """Claim slots for absent, batch-unique ``keys`` in one launch (atomic compare-and-swap
    on EMPTY or TOMBSTONE). Returns a bool mask of keys still unplaced after MAX_PROBES
    (the caller places those with the torch loop)."""
    index_keys, index_values = index.raw_tables()
    n = len(keys)
    left = torch.zeros(n, dtype=torch.int8, device=keys.device)
    if n == 0:
        return left.bool()
    block = 256
    scratch = torch.zeros(triton.cdiv(n, block) * block, dtype=torch.int64, device=keys.device)  # one word per lane
    bits = index.bits
    _insert[(triton.cdiv(n, block),)](keys, values, index_keys, index_values, scratch, left, n, MULTIPLIER, 64 - bits,
                                      (1 << bits) - 1, EMPTY, TOMBSTONE, BLOCK=block, PROBES=MAX_PROBES)
    return left.bool()


def probe_gather(ids: torch.Tensor, index: SlotTables, weights: torch.Tensor, last_seen: torch.Tensor,
                 now_ms: int, update_clock: bool = True, count_misses: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [n, dim], slots [n], misses [1]) for ids looked up in ``index`` over ``weights``:
    slot -1 = absent, -2 = undecided after MAX_PROBES (rows are zeros for both); the rows
    hit get ``last_seen = now_ms``; ``misses`` counts the ids that were not hits."""
    index_keys, index_values = index.raw_tables()
    bits = index.bits
    n, dim = len(ids), weights.shape[1]
    out = torch.empty(n, dim, device=ids.device, dtype=weights.dtype)
    slots = torch.empty(n, device=ids.device, dtype=torch.int64)
    misses = torch.zeros(1, device=ids.device, dtype=torch.int32)
    if n == 0:
        return out, slots, misses
    block = 128 if dim <= 64 else 32
    grid = (triton.cdiv(n, block),)
    _probe_gather[grid](ids, index_keys, index_values, weights, out, slots, last_seen, misses, now_ms,
                        n, MULTIPLIER, 64 - bits, (1 << bits) - 1, EMPTY, TOMBSTONE,
                        DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim), BLOCK=block, PROBES=MAX_PROBES,
                        UPDATE_CLOCK=update_clock, COUNT_MISSES=count_misses, GATHER=True, REMOVE=False)
    return out, slots, misses


def probe_gather_grouped(ids: torch.Tensor, counts: list[int], tiers: list, now_ms: int,
                         count_absent: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """``probe_gather`` of several tiers of one row width (RowStorage on one CUDA device) in
    one launch, table-batched as ``find_or_insert_grouped`` is: ``ids`` (int64 on that
    device) holds each tier's ids one group after another (``counts[g]`` of them, repeats
    allowed); the tiers may differ in capacity and index size. Returns (rows float32
    [len(ids), dim] in ``ids``' order, zeros where no hit; pending int32 [groups]), both in
    HBM: group g's ids that were not hits where ``count_absent[g]``, else only its ids
    undecided after MAX_PROBES (a complete cache: an absent id has no row, and its zeros
    are the answer). The rows hit get ``last_seen = now_ms``; the indexes are only read.
    Why: a serving read of five tables costs five launches through Triton's Python
    launcher; here one."""
    dim = tiers[0].dim
    n = len(ids)
    out = torch.empty(n, dim, device=ids.device, dtype=torch.float32)
    pending = torch.zeros(len(tiers), device=ids.device, dtype=torch.int32)
    if n == 0:
        return out, pending
    block = 128 if dim <= 64 else 32
    layout, blocks = group_blocks(counts, block)
    rows = []
    for placed, tier, absent in zip(layout, tiers, count_absent):
        index_keys, index_values = tier.index.raw_tables()
        rows.append([*placed, tier.index.bits, -1 if absent else -2, index_keys.data_ptr(), index_values.data_ptr(),
                     tier.weights.data_ptr(), tier.last_seen.data_ptr()])
    groups = to_device_async(rows, ids.device)
    _probe_gather_grouped[(blocks,)](ids, groups, out, pending, now_ms, MULTIPLIER, EMPTY, TOMBSTONE, GROUPS=len(tiers),
                                     FIELDS=PROBE_GATHER_FIELDS, DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim), BLOCK=block,
                                     PROBES=MAX_PROBES)
    return out, pending


def probe(keys: torch.Tensor, index: SlotTables, remove: bool = False) -> torch.Tensor:
    """Slots of ``keys`` in ``index`` in one launch: -1 absent, -2 undecided after MAX_PROBES.
    ``remove``: the keys found are also removed (their index slots become tombstones);
    ``keys`` must then be unique in the batch."""
    index_keys, index_values = index.raw_tables()
    n = len(keys)
    slots = torch.empty(n, device=keys.device, dtype=torch.int64)
    if n == 0:
        return slots
    block = 256
    bits = index.bits
    _probe_gather[(triton.cdiv(n, block),)](keys, index_keys, index_values, index_keys, slots, slots, index_keys, slots, 0,
                                            n, MULTIPLIER, 64 - bits, (1 << bits) - 1, EMPTY, TOMBSTONE,
                                            DIM=1, DIM_BLOCK=1, BLOCK=block, PROBES=MAX_PROBES,
                                            UPDATE_CLOCK=False, COUNT_MISSES=False, GATHER=False, REMOVE=remove)
    return slots


if triton is not None:

    @triton.jit
    def _find_or_insert_block(key, valid, offs, index_keys_ptr, index_values_ptr, scratch_ptr, fresh_ptr, counters_ptr,
                              weights_ptr, state_ptr, last_seen_ptr, row_keys_ptr, live_ptr, dirty_ptr, out_ptr, slots_ptr,
                              now, multiplier, shift, mask, empty, seed, init_std, state_fill,
                              DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, STATE_DIM: tl.constexpr,
                              STATE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
        """One block of batch-unique keys of one tier (``offs``: their positions in out/slots)."""
        pos = ((key * multiplier) >> shift) & mask
        slot = tl.full((BLOCK,), -1, tl.int64)
        created = offs < 0  # all False
        reserved = valid & ((key == empty) | (key == empty + 1))  # EMPTY / TOMBSTONE: torch refuses them
        pending = valid & ~reserved
        for _ in range(PROBES):
            found = tl.load(index_keys_ptr + pos, mask=pending, other=0)
            hit = pending & (found == key)
            slot = tl.where(hit, tl.load(index_values_ptr + pos, mask=hit, other=-1), slot)
            pending = pending & ~hit
            # the key is absent once its chain reaches an EMPTY slot: claim that slot (keys are
            # unique in the batch, so only different keys race for it; a loser probes on)
            claim = pending & (found == empty)
            target = tl.where(claim, index_keys_ptr + pos, scratch_ptr + offs)
            old = tl.atomic_cas(target, empty + tl.zeros((BLOCK,), tl.int64), key)
            won = claim & (old == empty)
            created = created | won
            pending = pending & ~won
            pos = tl.where(pending, (pos + 1) & mask, pos)
        # row slots for the created keys: one atomic per block, ranks by prefix sum
        made = created.to(tl.int32)
        base = tl.atomic_add(counters_ptr, tl.sum(made, axis=0))
        rank = base + tl.cumsum(made, axis=0) - made
        new_slot = tl.load(fresh_ptr + rank, mask=created, other=-1)
        tl.store(index_values_ptr + pos, new_slot, mask=created)
        slot = tl.where(created, new_slot, slot)
        pending = pending | reserved
        tl.atomic_add(counters_ptr + 1, tl.sum(pending.to(tl.int32), axis=0))
        slot = tl.where(pending, -2, slot)  # gave up probing: the caller decides with torch
        tl.store(slots_ptr + offs, slot, mask=valid)
        safe = tl.where(slot >= 0, slot, 0)
        tl.store(last_seen_ptr + safe, now + tl.zeros((BLOCK,), tl.int64), mask=slot >= 0)
        tl.store(row_keys_ptr + safe, key, mask=created)
        tl.store(live_ptr + safe, made.to(tl.int8), mask=created)
        tl.store(dirty_ptr + safe, tl.full((BLOCK,), 1, tl.int8), mask=created)
        cols = tl.arange(0, DIM_BLOCK)
        col_ok = (cols < DIM)[None, :]
        init = tl.randn(seed, (rank[:, None] * DIM + cols[None, :]).to(tl.int32)) * init_std
        tl.store(weights_ptr + safe[:, None] * DIM + cols[None, :], init, mask=created[:, None] & col_ok)
        scols = tl.arange(0, STATE_BLOCK)
        tl.store(state_ptr + safe[:, None] * STATE_DIM + scols[None, :], state_fill + tl.zeros((BLOCK, STATE_BLOCK), tl.float32),
                 mask=created[:, None] & (scols < STATE_DIM)[None, :])
        hit = (slot >= 0) & ~created
        rows = tl.load(weights_ptr + safe[:, None] * DIM + cols[None, :], mask=hit[:, None] & col_ok, other=0.0)
        rows = tl.where(created[:, None], init, rows)
        tl.store(out_ptr + offs[:, None] * DIM + cols[None, :], rows, mask=valid[:, None] & col_ok)

    @triton.jit(do_not_specialize=["now", "n", "multiplier", "shift", "mask", "empty", "seed", "init_std", "state_fill"])
    def _find_or_insert(keys_ptr, index_keys_ptr, index_values_ptr, scratch_ptr, fresh_ptr, counters_ptr,
                        weights_ptr, state_ptr, last_seen_ptr, row_keys_ptr, live_ptr, dirty_ptr, out_ptr, slots_ptr,
                        now, n, multiplier, shift, mask, empty, seed, init_std, state_fill,
                        DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, STATE_DIM: tl.constexpr, STATE_BLOCK: tl.constexpr,
                        BLOCK: tl.constexpr, PROBES: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        key = tl.load(keys_ptr + offs, mask=valid, other=0)
        _find_or_insert_block(key, valid, offs, index_keys_ptr, index_values_ptr, scratch_ptr, fresh_ptr, counters_ptr,
                              weights_ptr, state_ptr, last_seen_ptr, row_keys_ptr, live_ptr, dirty_ptr, out_ptr, slots_ptr,
                              now, multiplier, shift, mask, empty, seed, init_std, state_fill,
                              DIM, DIM_BLOCK, STATE_DIM, STATE_BLOCK, BLOCK, PROBES)

    @triton.jit(do_not_specialize=["now", "multiplier", "empty", "init_std", "state_fill"])
    def _find_or_insert_grouped(keys_ptr, groups_ptr, scratch_ptr, counters_ptr, out_ptr, slots_ptr,
                                now, multiplier, empty, init_std, state_fill,
                                GROUPS: tl.constexpr, FIELDS: tl.constexpr, DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, STATE_DIM: tl.constexpr,
                                STATE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
        # this program's table: the last whose first block is at or before it (FIND_OR_INSERT_FIELDS rows)
        pid = tl.program_id(0)
        g = 0
        for j in tl.static_range(1, GROUPS):
            g += (pid >= tl.load(groups_ptr + j * FIELDS + 2)).to(tl.int32)
        row = groups_ptr + g * FIELDS
        local = (pid - tl.load(row + 2)) * BLOCK + tl.arange(0, BLOCK)
        valid = local < tl.load(row + 1)
        offs = tl.load(row) + local
        key = tl.load(keys_ptr + offs, mask=valid, other=0)
        bits = tl.load(row + 3)
        i64 = tl.pointer_type(tl.int64)
        f32 = tl.pointer_type(tl.float32)
        i8 = tl.pointer_type(tl.int8)
        _find_or_insert_block(key, valid, offs, tl.load(row + 5).to(i64), tl.load(row + 6).to(i64), scratch_ptr,
                              tl.load(row + 7).to(i64), counters_ptr + 2 * g, tl.load(row + 8).to(f32),
                              tl.load(row + 9).to(f32), tl.load(row + 10).to(i64), tl.load(row + 11).to(i64),
                              tl.load(row + 12).to(i8), tl.load(row + 13).to(i8), out_ptr, slots_ptr,
                              now, multiplier, 64 - bits, (tl.full((), 1, tl.int64) << bits) - 1, empty, tl.load(row + 4),
                              init_std, state_fill, DIM, DIM_BLOCK, STATE_DIM, STATE_BLOCK, BLOCK, PROBES)


def find_or_insert(keys: torch.Tensor, tier, fresh: torch.Tensor, counters: torch.Tensor, now_ms: int, seed: int,
                   init_std: float, state_fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and slots for batch-unique ``keys`` in ``tier`` (a RowStorage on CUDA), creating
    the absent ones in the same launch: an index slot claimed by compare-and-swap, a row
    slot taken from ``fresh`` in order, weights drawn on the device (N(0, init_std) from
    ``seed``), state filled with ``state_fill``, the row marked live and dirty. Hit and
    created rows get ``last_seen = now_ms``. ``counters`` (int32[2], zeroed) receives
    (rows created, keys undecided after MAX_PROBES or reserved: slot -2, rows zeros). The caller
    guarantees room: ``len(fresh) >= len(keys)`` and index load stays <= its maximum."""
    index_keys, index_values = tier.index.raw_tables()
    bits = tier.index.bits
    n, dim, state_dim = len(keys), tier.dim, tier.state_dim
    out = torch.empty(n, dim, device=keys.device, dtype=tier.weights.dtype)
    slots = torch.empty(n, device=keys.device, dtype=torch.int64)
    if n == 0:
        return out, slots
    block = _fi_block(dim)
    scratch = torch.zeros(triton.cdiv(n, block) * block, dtype=torch.int64, device=keys.device)
    _find_or_insert[(triton.cdiv(n, block),)](
        keys, index_keys, index_values, scratch, fresh, counters, tier.weights, tier.state, tier.last_seen, tier.keys,
        tier.live.view(torch.int8), tier.dirty, out, slots, now_ms, n, MULTIPLIER, 64 - bits, (1 << bits) - 1, EMPTY, seed,
        init_std, state_fill, DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim), STATE_DIM=state_dim,
        STATE_BLOCK=triton.next_power_of_2(state_dim), BLOCK=block, PROBES=MAX_PROBES)
    return out, slots


def _fi_block(dim: int) -> int:
    return 128 if dim <= 64 else 32


def find_or_insert_grouped(keys: torch.Tensor, counts: list[int], tiers: list, fresh: list[torch.Tensor],
                           counters: torch.Tensor, now_ms: int, seeds: list[int], init_std: float,
                           state_fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``find_or_insert`` for several tiers of one row shape in one launch (table-batched):
    ``keys`` holds each tier's batch-unique keys one group after another (``counts[g]`` of
    them), ``fresh[g]`` and ``seeds[g]`` are group g's, and ``counters`` (int32[groups, 2],
    zeroed) receives each group's (created, undecided). Rows and slots come back in ``keys``'
    order. Why: five tables cost five launches through Triton's Python launcher and five
    sets of scratch buffers a step; here one."""
    first = tiers[0]
    dim, state_dim = first.dim, first.state_dim
    n = len(keys)
    out = torch.empty(n, dim, device=keys.device, dtype=first.weights.dtype)
    slots = torch.empty(n, device=keys.device, dtype=torch.int64)
    if n == 0:
        return out, slots
    block = _fi_block(dim)
    layout, blocks = group_blocks(counts, block)
    rows = []
    for placed, tier, f, seed in zip(layout, tiers, fresh, seeds):
        index_keys, index_values = tier.index.raw_tables()
        rows.append([*placed, tier.index.bits, seed, index_keys.data_ptr(), index_values.data_ptr(),
                     f.data_ptr(), tier.weights.data_ptr(), tier.state.data_ptr(), tier.last_seen.data_ptr(),
                     tier.keys.data_ptr(), tier.live.data_ptr(), tier.dirty.data_ptr()])
    groups = to_device_async(rows, keys.device)
    # compare-and-swap targets of lanes not claiming: never EMPTY, so never written (a group's
    # tail lanes share words with the next group's first lanes, harmlessly)
    scratch = torch.zeros(n + block, dtype=torch.int64, device=keys.device)
    _find_or_insert_grouped[(blocks,)](keys, groups, scratch, counters, out, slots, now_ms, MULTIPLIER, EMPTY, init_std,
                                       state_fill, GROUPS=len(tiers), FIELDS=FIND_OR_INSERT_FIELDS, DIM=dim, DIM_BLOCK=triton.next_power_of_2(dim),
                                       STATE_DIM=state_dim, STATE_BLOCK=triton.next_power_of_2(state_dim), BLOCK=block,
                                       PROBES=MAX_PROBES)
    return out, slots


def group_blocks(counts: list[int], block: int) -> tuple[list[tuple[int, int, int]], int]:
    """A grouped launch's layout, ``block`` rows per program: each group's (first row, rows,
    first program), a group's rows never sharing a program with another's, and the programs
    in all. The first three fields of every grouped kernel's per-group row."""
    layout, start, programs = [], 0, 0
    for count in counts:
        layout.append((start, count, programs))
        start, programs = start + count, programs + -(-count // block)
    return layout, programs


def to_device_async(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """A small int64 table on the device without a host sync: through pinned memory (torch's
    caching host allocator keeps the buffer until the copy has run)."""
    return torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


if triton is not None:

    @triton.jit(do_not_specialize=["n"])
    def _copy_rows(src_w_ptr, src_s_ptr, src_t_ptr, src_slots_ptr, dst_w_ptr, dst_s_ptr, dst_t_ptr, dst_slots_ptr, flags_ptr, n,
                   DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, STATE_DIM: tl.constexpr, STATE_BLOCK: tl.constexpr,
                   BLOCK: tl.constexpr, HAS_FLAGS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        src = tl.load(src_slots_ptr + offs, mask=valid, other=-1)
        dst = tl.load(dst_slots_ptr + offs, mask=valid, other=-1)
        ok = valid & (src >= 0) & (dst >= 0)
        src = tl.where(ok, src, 0)
        dst = tl.where(ok, dst, 0)
        tl.store(dst_t_ptr + dst, tl.load(src_t_ptr + src, mask=ok, other=0), mask=ok)
        rows = ok
        if HAS_FLAGS:
            rows = ok & (tl.load(flags_ptr + offs, mask=valid, other=0) != 0)
        cols = tl.arange(0, DIM_BLOCK)
        m = rows[:, None] & (cols < DIM)[None, :]
        w = tl.load(src_w_ptr + src[:, None] * DIM + cols[None, :], mask=m, other=0.0)
        tl.store(dst_w_ptr + dst[:, None] * DIM + cols[None, :], w, mask=m)
        scols = tl.arange(0, STATE_BLOCK)
        sm = rows[:, None] & (scols < STATE_DIM)[None, :]
        st = tl.load(src_s_ptr + src[:, None] * STATE_DIM + scols[None, :], mask=sm, other=0.0)
        tl.store(dst_s_ptr + dst[:, None] * STATE_DIM + scols[None, :], st, mask=sm)


def copy_rows(src, src_slots: torch.Tensor, dst, dst_slots: torch.Tensor, values_where: torch.Tensor | None = None) -> None:
    """Copy rows between two tiers (RowStorage; either may be a mapped host tier, read and
    written in place over PCIe) in one launch: ``src`` row ``src_slots[i]`` to ``dst`` row
    ``dst_slots[i]`` (pairs with a negative slot are skipped). The clock always moves; weights
    and optimizer state move where ``values_where`` (int8/bool per pair) is set, or always.
    The GPU cache evicts this way (dirty rows whole, clean ones only their clock) and brings
    DRAM rows up."""
    n = len(src_slots)
    if n == 0:
        return
    device = src_slots.device
    block = 128 if max(src.dim, src.state_dim) <= 64 else 32
    flags = values_where if values_where is not None else src_slots
    _copy_rows[(triton.cdiv(n, block),)](
        src.weights, src.state, src.last_seen, src_slots, dst.weights, dst.state, dst.last_seen, dst_slots.to(device), flags, n,
        DIM=src.dim, DIM_BLOCK=triton.next_power_of_2(src.dim), STATE_DIM=src.state_dim,
        STATE_BLOCK=triton.next_power_of_2(max(src.state_dim, 1)), BLOCK=block, HAS_FLAGS=values_where is not None)
