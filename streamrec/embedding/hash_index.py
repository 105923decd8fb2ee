"""A vectorised open-addressing hash index: int64 keys -> int64 row slots, in torch.

Why hand-written: torch has no hash map, and a per-key Python dict pays the interpreter
for every key and never runs on a GPU. This index probes a whole batch at once with
tensor ops, so the same code serves the DRAM tier (CPU) and the GPU cache (CUDA), and
collisions are impossible by construction: the index stores full keys (Monolith's point,
versus hashing ids into a fixed table).

Linear probing, load factor <= 0.5, tombstones for removal, rehash on growth. Two int64
values are reserved as markers and cannot be keys (see RESERVED_KEYS).
"""

from __future__ import annotations

import torch

from streamrec.embedding import kernels
from streamrec.embedding.hash_layout import EMPTY, MAX_LOAD, MULTIPLIER, RESERVED_KEYS, TOMBSTONE, index_bits
from streamrec.embedding.host_memory import mapped_full

REHASH_SLICE = 1 << 20


class ReservedKeyError(ValueError):
    """A key equal to one of the two reserved marker values."""


class HashIndex:
    def __init__(self, capacity: int = 1024, device: torch.device | str = "cpu", fixed: bool = False,
                 mapped: bool = False) -> None:
        """``capacity`` keys fit at a load of at most MAX_LOAD. ``fixed``: the index of a
        tier with a budget; a rebuild drops tombstones in place instead of growing, so its
        memory stays what the budget counted (it grows only if more than ``capacity`` keys
        are live at once). ``mapped``: a host index whose slot arrays GPU kernels probe in
        place (host_memory.py; the DRAM tier under a GPU cache)."""
        self.device = torch.device(device)
        self.fixed = fixed
        self.mapped = mapped
        self._bits = index_bits(capacity)
        self._keys, self._values = self._slot_arrays(self._bits)
        self._used = 0  # slots not EMPTY (live keys + tombstones): what fills the probe chains

    def __len__(self) -> int:
        return int((self._keys > TOMBSTONE).sum())

    def _slot_arrays(self, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mapped:
            return mapped_full(1 << bits, EMPTY, torch.int64), mapped_full(1 << bits, -1, torch.int64)
        return (torch.full((1 << bits,), EMPTY, dtype=torch.int64, device=self.device),
                torch.full((1 << bits,), -1, dtype=torch.int64, device=self.device))

    @property
    def slots(self) -> int:
        return 1 << self._bits

    def _hash(self, keys: torch.Tensor) -> torch.Tensor:
        return ((keys * MULTIPLIER) >> (64 - self._bits)) & ((1 << self._bits) - 1)

    def _find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices into ``keys``, slot positions) of the keys that are present.

        Probes the whole batch per round: each unresolved key looks at its current
        position; hits and empty slots resolve it, the rest move one slot on.
        """
        found_idx = [torch.empty(0, dtype=torch.int64, device=self.device)]
        found_pos = [torch.empty(0, dtype=torch.int64, device=self.device)]
        active = torch.arange(len(keys), device=self.device)
        pos = self._hash(keys)
        mask = self.slots - 1
        while len(active):
            found = self._keys[pos]
            hit = found == keys[active]
            found_idx.append(active[hit])
            found_pos.append(pos[hit])
            keep = ~(hit | (found == EMPTY))
            active, pos = active[keep], (pos[keep] + 1) & mask
        return torch.cat(found_idx), torch.cat(found_pos)

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Values for ``keys`` (-1 where absent). Works for duplicate keys."""
        keys = keys.to(self.device, torch.int64)
        if kernels.available(self.device):
            out = kernels.probe(keys, self)  # one launch, no host sync
            undecided = torch.nonzero(out == -2).squeeze(1)
            if len(undecided):  # a probe chain longer than the kernel's limit: rare
                out[undecided] = -1
                idx, pos = self._find(keys[undecided])
                out[undecided[idx]] = self._values[pos]
            return out
        out = torch.full_like(keys, -1)
        idx, pos = self._find(keys)
        out[idx] = self._values[pos]
        return out

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Insert keys that are *not present* and unique within the batch."""
        keys = keys.to(self.device, torch.int64)
        values = values.to(self.device, torch.int64)
        if len(keys) == 0:
            return
        if bool(((keys == EMPTY) | (keys == TOMBSTONE)).any()):
            raise ReservedKeyError(f"keys {RESERVED_KEYS} are reserved by the hash index and cannot be feature ids")
        if (self._used + len(keys)) > MAX_LOAD * self.slots:
            self._rehash(self._used + len(keys))
        if kernels.available(self.device):
            self._used += len(keys)  # the kernel does not say which slots were tombstones: all count
            left = kernels.insert(keys, values, self)  # one launch instead of probe rounds with host syncs
            keys, values = keys[left], values[left]  # (almost always none)
            self._place(keys, values)
        else:
            self._used += self._place(keys, values)  # a key that takes a tombstone's slot fills nothing new

    def reserve(self, n: int) -> None:
        """Grow now if ``n`` more keys would pass the load limit (before a kernel inserts
        them itself, see ``kernels.find_or_insert``; report them with ``note_inserted``)."""
        if self._used + n > MAX_LOAD * self.slots:
            self._rehash(self._used + n)

    def note_inserted(self, n: int) -> None:
        self._used += n

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Linear-probing insert of absent, unique keys, a whole batch per round (a key
        takes the first EMPTY or TOMBSTONE slot of its chain); returns how many EMPTY
        slots were filled."""
        pos = self._hash(keys)
        mask = self.slots - 1
        pending = torch.arange(len(keys), device=self.device)
        filled = 0
        while len(pending):
            seen = self._keys[pos]
            free = seen <= TOMBSTONE
            claimers = pending[free]
            claim_pos = pos[free]
            was_empty = seen[free] == EMPTY
            self._keys[claim_pos] = keys[claimers]  # racing claimers of one slot: one wins
            won = self._keys[claim_pos] == keys[claimers]
            filled += int((was_empty & won).sum())
            self._values[claim_pos[won]] = values[claimers[won]]
            lost = torch.ones(len(pending), dtype=torch.bool, device=self.device)
            lost[torch.nonzero(free).squeeze(1)[won]] = False
            pending, pos = pending[lost], (pos[lost] + 1) & mask
        return filled

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove present keys (unique within the batch); returns the values they had (-1
        for absent ones)."""
        keys = keys.to(self.device, torch.int64)
        if kernels.available(self.device):
            out = kernels.probe(keys, self, remove=True)  # one launch instead of probe rounds with host syncs
            undecided = torch.nonzero(out == -2).squeeze(1)
            if len(undecided) == 0:
                return out
            out[undecided] = self._remove(keys[undecided])  # a chain longer than the kernel's limit: rare
            return out
        return self._remove(keys)

    def _remove(self, keys: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(keys, -1)
        idx, pos = self._find(keys)
        out[idx] = self._values[pos]
        self._keys[pos] = TOMBSTONE
        self._values[pos] = -1
        return out

    @property
    def bits(self) -> int:
        """log2 of the slot count (kernels reproduce the hash with it)."""
        return self._bits

    def raw_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (keys, values) slot arrays, for kernels that probe the index themselves."""
        return self._keys, self._values

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        live = self._keys > TOMBSTONE
        return self._keys[live], self._values[live]

    def _rehash(self, need: int) -> None:
        """Rebuild without tombstones for ``need`` keys as ``_used`` counts them. Sized for
        the live keys plus the incoming ones, to a load of at most 3/8 (so the next rehash
        is at least 1/8 of the slots away): tombstones are not sized for, so an index whose
        keys churn (a DRAM tier spilling to SSD) keeps its size; a ``fixed`` index keeps it
        while the keys fit at MAX_LOAD. The same size is rebuilt in place, and keys go back
        in slices, so the temporaries of a rebuild stay small next to the index."""
        keys, values = self.items()
        need += len(keys) - self._used
        if self.fixed and need <= MAX_LOAD * self.slots:
            bits = self._bits
        else:
            bits = max(self._bits, (max(1, -(-need * 8 // 3)) - 1).bit_length())
        if self.mapped:  # GPU kernels probe a mapped index: none may run while it is rebuilt
            torch.cuda.synchronize()
        if bits == self._bits:
            self._keys.fill_(EMPTY)
            self._values.fill_(-1)
        else:
            self._bits = bits
            self._keys = self._values = None  # free the old arrays before allocating the new ones
            self._keys, self._values = self._slot_arrays(bits)
        self._used = 0
        for lo in range(0, len(keys), REHASH_SLICE):
            self.insert(keys[lo : lo + REHASH_SLICE], values[lo : lo + REHASH_SLICE])
