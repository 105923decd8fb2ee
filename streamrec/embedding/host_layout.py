"""The sharded exchange's layout of a step's ids, made on the host with numpy alone: the
trainer's sample reader process makes it for every batch without loading torch
(embedding/sharded.py ``layout_on_host`` wraps it for the training process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping

import numpy as np
import pyarrow as pa

_MIX = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64 (splitmix64's multiplier)


def owner_of(keys, world: int):
    """The rank that owns each key (int64 keys: a numpy array, or a tensor alike). A different
    mix than the hash index's (which takes the top bits of ``key * 0x9E37...``), so one shard's
    keys do not crowd one part of its index."""
    mixed = keys >> 31  # then in place: one buffer, not one per operation
    mixed ^= keys
    mixed *= _MIX
    mixed >>= 32
    mixed &= 0x7FFFFFFF
    mixed %= world
    return mixed


@dataclass
class HostLayout:
    """A step's sharded ids laid out for their owners (``lay_out``)."""

    names: list[str]
    sizes: list[int]  # input ids per table
    routed: np.ndarray  # int64 [keys + ids]: the keys in send order (by owner, table, key), then each input id's place among them
    send_counts: list[int]  # keys to each (owner, table), owner-major


def lay_out(ids: Mapping[str, np.ndarray], world: int, every_sighting: Collection[str] = (),
            allocate: Callable[[int], np.ndarray] = lambda n: np.empty(n, np.int64)) -> HostLayout:
    """``ShardedCollection.plan``'s layout of ``ids`` (table -> flat int64 [n]) over ``world``
    ranks: each table's distinct ids (a hash de-duplication, then sorted), every one's (owner,
    table) as one small code, the distinct ids put in code order by one stable sort, then
    counted; each input id's place among them. The tables in ``every_sighting`` (an admission
    sketch counts every sighting) keep every id, sorted. ``allocate(n)``: the int64 [n] array
    ``routed`` is written into (the caller's page-locked buffer, say)."""
    names = list(ids)
    # per table: its keys sorted (distinct unless every sighting counts), the order that sorts
    # them, and each input id's key (None: each id its own key, in input order)
    distinct, sorts, of_ids = [], [], []
    for name in names:
        flat = ids[name]
        if name in every_sighting:  # each id its own key
            values, of_id = flat, None
        else:
            encoded = pa.array(flat, pa.int64()).dictionary_encode()  # hashed: no sort of every id
            values, of_id = encoded.dictionary.to_numpy(), encoded.indices.to_numpy(zero_copy_only=False)
        by_key = np.argsort(values, kind="stable")
        distinct.append(values[by_key])
        sorts.append(by_key)
        of_ids.append(of_id)
    counts_by_table = [len(k) for k in distinct]
    keys = np.concatenate(distinct) if distinct else np.empty(0, np.int64)
    groups = world * len(names)
    code = owner_of(keys, world) * len(names) + np.repeat(np.arange(len(names)), counts_by_table)
    code = code.astype(np.uint8 if groups <= 256 else np.int32)
    send = np.argsort(code, kind="stable")
    sent_at = np.empty(len(keys), np.int64)  # each distinct key's place in send order
    sent_at[send] = np.arange(len(keys))
    sizes = [len(ids[name]) for name in names]  # each table's input ids
    out = allocate(len(keys) + sum(sizes))
    np.take(keys, send, out=out[:len(keys)], mode="clip")  # mode="clip": no buffered copy of the output
    first_key, at = 0, len(keys)
    for by_key, of_id, n_keys, n_ids in zip(sorts, of_ids, counts_by_table, sizes):
        placed = np.empty(n_keys, np.int64)  # each of the table's values (before sorting): its key's place in send order
        placed[by_key] = sent_at[first_key:first_key + n_keys]
        if of_id is None:
            out[at:at + n_ids] = placed
        else:
            np.take(placed, of_id, out=out[at:at + n_ids], mode="clip")  # each input id's key's place: one gather
        first_key, at = first_key + n_keys, at + n_ids
    counts = np.bincount(code, minlength=groups)
    return HostLayout(names, sizes, out, counts.tolist())


