"""What the next delta holds, and expiry, which feeds it deletions.

Created and updated keys are "touched", expired keys "deleted"; a delta snapshot takes
both (``begin_delta``) and reads the touched keys' values then: a key without a row by
that time is published as deleted. Checkpoints keep what is tracked (``tracked`` /
``set_tracked``), so a resumed trainer publishes what it had not yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from streamrec.embedding.placement import Placement


class DeltaTracker:
    def __init__(self, device: torch.device) -> None:
        """``device``: the top tier's (touched keys stay there: no host sync per step)."""
        self.device = device
        self._touched: list[torch.Tensor] = []
        self._deleted: list[torch.Tensor] = []

    def track(self, keys: torch.Tensor) -> None:
        """Remember updated/created keys for the next delta, on the top tier's device (no
        host sync per step); compacted now and then so memory follows distinct keys."""
        self._touched.append(keys.to(self.device))
        if len(self._touched) >= 64:
            self._touched = [torch.unique(torch.cat(self._touched))]

    def delete(self, keys: torch.Tensor) -> None:
        """Keys whose rows are gone (expired): the next delta deletes them."""
        self._deleted.append(keys.cpu())

    def begin_delta(self) -> torch.Tensor:
        """Keys changed (updated, created or deleted) since the last call, on the top tier's
        device; resets the tracking."""
        device = self.device
        touched = torch.unique(torch.cat(self._touched)) if self._touched else torch.empty(0, dtype=torch.int64, device=device)
        deleted = torch.cat(self._deleted).to(device) if self._deleted else None
        self._touched, self._deleted = [], []
        return touched if deleted is None else torch.unique(torch.cat([touched, deleted]))

    def tracked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(touched, deleted) keys pending for the next delta, on CPU (for checkpoints)."""
        touched = torch.unique(torch.cat(self._touched)).cpu() if self._touched else torch.empty(0, dtype=torch.int64)
        deleted = torch.cat(self._deleted) if self._deleted else torch.empty(0, dtype=torch.int64)
        return touched, deleted

    def set_tracked(self, touched: torch.Tensor, deleted: torch.Tensor) -> None:
        """Resume the tracking a checkpoint kept (``tracked``'s pair)."""
        self._touched = [touched.to(self.device)] if len(touched) else []
        self._deleted = [deleted.cpu()] if len(deleted) else []


def expire_rows(placement: "Placement", ttl_s: float, now_ms: int) -> torch.Tensor:
    """Delete the rows of every tier unseen for ``ttl_s`` (by the caller's clock), reporting
    them to the placement's tracker as deletions; returns their keys (CPU)."""
    tiers = placement.tiers
    cutoff = now_ms - int(ttl_s * 1000)
    expired = []
    if tiers.cache is not None:
        live = tiers.cache.live_slots()
        stale = tiers.cache.keys[live[tiers.cache.last_seen[live] < cutoff]]
        if len(stale):
            placement.write_back(stale)  # the DRAM copy is then expired below
    dram = tiers.dram
    top = dram.high_water
    stale = torch.nonzero(dram.live[:top] & (dram.last_seen[:top] < cutoff)).squeeze(1)
    if len(stale):  # a row still cached was seen since (its DRAM clock lags): it stays
        stale = stale[~placement.held(stale, torch.empty(0, dtype=torch.int64))]
        expired.append(dram.pop(dram.keys.index_select(0, stale))[0])
    if tiers.ssd is not None:
        expired.append(tiers.ssd.expire(cutoff))  # reads only the expiring rows (by clock)
    keys = torch.cat(expired) if expired else torch.empty(0, dtype=torch.int64)
    if len(keys):
        placement.tracker.delete(keys)
    if tiers.cache is not None and not tiers.cache_complete:
        tiers.refresh_cache_complete()  # expired cache rows were evicted first: the cache may be whole again
    return keys
