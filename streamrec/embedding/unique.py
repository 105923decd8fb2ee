"""``torch.unique`` of several id tensors (one per table) with one host sync for all.

Why: on CUDA each ``torch.unique`` waits for the device to learn its output size, so a
batch over five tables paid five round trips before any lookup started. Here all ids are
sorted together by (table, id), the distinct count of every table comes back in one
transfer, and the rest (keys, inverse, counts) is built on the device.
"""

from __future__ import annotations

import torch


def unique_per_group(groups: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each int64 tensor: (sorted unique keys, inverse, counts), as ``torch.unique``
    with ``return_inverse`` and ``return_counts`` gives them."""
    if not groups:
        return []
    keys, inverse, counts, distinct = unique_concat(groups)
    out, start_id, start_key = [], 0, 0
    for g, n_keys in zip(groups, distinct):
        size, end_key = g.numel(), start_key + n_keys
        out.append((keys[start_key:end_key], inverse[start_id:start_id + size] - start_key, counts[start_key:end_key]))
        start_id, start_key = start_id + size, end_key
    return out


def unique_concat(groups: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """``unique_per_group`` as one tensor each: (every group's sorted unique keys, one group
    after another; the inverse of every id into those keys; counts; the distinct count of
    each group, on the host)."""
    device = groups[0].device
    ids = torch.cat([g.reshape(-1) for g in groups])
    # the tag of each id: fills, not repeat_interleave (which would wait for the device)
    tags = torch.cat([torch.full((g.numel(),), t, dtype=torch.int64, device=device) for t, g in enumerate(groups)])
    return unique_tagged(ids, tags, len(groups))


def unique_tagged(ids: torch.Tensor, tags: torch.Tensor, n_tags: int, every_id: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The distinct (tag, id) pairs of ``ids`` (int64 [n]) tagged by ``tags`` (int64 [n], each
    in [0, n_tags)), in any order: (their ids sorted by (tag, id); the inverse of every id
    into them; counts; the distinct count of each tag, on the host: the one host sync).
    ``every_id`` (bool [n]): ids kept each on its own, duplicates included (sorted among the
    others, ties in input order)."""
    device, n = ids.device, len(ids)
    if n == 0:
        keys, inverse, counts = (torch.empty(0, dtype=torch.int64, device=device) for _ in range(3))
        return keys, inverse, counts, [0] * n_tags
    by_id = torch.argsort(ids, stable=True)
    order = by_id[torch.argsort(tags[by_id], stable=True)]  # sorted by (tag, id), ties in input order
    sorted_ids, sorted_tags = ids[order], tags[order]
    first = torch.ones(n, dtype=torch.bool, device=device)
    first[1:] = (sorted_ids[1:] != sorted_ids[:-1]) | (sorted_tags[1:] != sorted_tags[:-1])
    if every_id is not None:
        first |= every_id[order]
    rank = torch.cumsum(first, 0) - 1  # position among the distinct (tag, id) pairs
    per_tag = torch.zeros(n_tags, dtype=torch.int64, device=device).index_add_(0, sorted_tags, first.long())
    totals_list = per_tag.tolist()  # the one host sync
    total = sum(totals_list)
    keys = torch.empty(total, dtype=torch.int64, device=device).scatter_(0, rank, sorted_ids)
    counts = torch.zeros(total, dtype=torch.int64, device=device).index_add_(0, rank, torch.ones_like(rank))
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    inverse[order] = rank
    return keys, inverse, counts, totals_list
