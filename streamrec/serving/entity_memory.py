"""Where the online features keep each entity's state: in memory up to a byte budget
(``serving.feature_store_memory_mb``), the least recently updated spilled past it to RocksDB
(``serving.feature_store_dir``). The spill is scratch: the features topic is the source of
truth and a start rebuilds from it. Not thread-safe: :class:`OnlineFeatures` holds its lock."""

from __future__ import annotations

import shutil
from array import array
from collections import OrderedDict
from pathlib import Path

import orjson

from streamrec.contracts.feature_state import ENTITIES, EntityCounts, UserHistory

EntityKey = tuple[str, int]  # (entity kind, id): ("user", 7), ("item", 12), ("category", 3)


class EntityState:
    """One entity's counter event times and, for a user, click history."""

    __slots__ = ("counts", "history", "nbytes")

    def __init__(self) -> None:
        self.counts: EntityCounts | None = None
        self.history: UserHistory | None = None
        self.nbytes = 0

    def size(self) -> int:
        return 64 + (self.counts.nbytes() if self.counts else 0) + (self.history.nbytes() if self.history else 0)

    def to_bytes(self) -> bytes:
        c, h = self.counts, self.history
        return orjson.dumps({"i": list(c.imps) if c else None, "c": list(c.clicks) if c else None,
                             "h": h.flat.tolist() if h else None})

    @classmethod
    def from_bytes(cls, data: bytes) -> "EntityState":
        raw, entity = orjson.loads(data), cls()
        if raw["i"] is not None:
            entity.counts = EntityCounts(array("q", raw["i"]), array("q", raw["c"]))
        if raw["h"] is not None:
            entity.history = UserHistory(array("q", raw["h"]))
        entity.nbytes = entity.size()
        return entity


class EntityMemory:
    """Entity states by key, least recently updated first; what exceeds ``budget_bytes`` spills."""

    def __init__(self, budget_bytes: int, spill_dir: str | Path) -> None:
        self.budget = budget_bytes
        self.spill_dir = Path(spill_dir)
        self.bytes = 0
        self.spills = self.reloads = 0
        self.entities_by_kind = {e: 0 for e in ENTITIES}
        self._entities: OrderedDict[EntityKey, EntityState] = OrderedDict()
        self._spilled: set[EntityKey] = set()
        self._spill = None  # rocksdict.Rdict, opened at the first spill

    @property
    def in_memory(self) -> int:
        return len(self._entities)

    @property
    def spilled(self) -> int:
        return len(self._spilled)

    def for_update(self, key: EntityKey) -> EntityState:
        """The entity under ``key`` for an update (made the most recently updated), from
        memory, the spill, or new."""
        entity = self._entities.get(key)
        if entity is not None:
            self._entities.move_to_end(key)
            return entity
        entity = self._reload(key)
        if entity is None:
            entity = EntityState()
            self.entities_by_kind[key[0]] += 1
            self._entities[key] = entity
        return entity

    def peek(self, key: EntityKey) -> EntityState | None:
        """The entity under ``key`` for a request: reads leave the LRU order alone (a move per
        lookup would be a large share of an assembly's time); updates move it."""
        entity = self._entities.get(key)
        if entity is None and key in self._spilled:
            entity = self._reload(key)
        return entity

    def keys(self) -> list[EntityKey]:
        """Every entity's key, in memory and spilled (a copy: safe to walk while updates go on)."""
        return [*self._entities.keys(), *self._spilled]

    def read(self, key: EntityKey) -> EntityState | None:
        """The entity under ``key`` without touching the LRU order or reloading a spilled one
        (a snapshot's walk must not churn the memory)."""
        entity = self._entities.get(key)
        if entity is None and key in self._spilled:
            entity = EntityState.from_bytes(self._spill[f"{key[0]}/{key[1]}"])
        return entity

    def put(self, key: EntityKey, entity: EntityState) -> None:
        """Add a new entity (a snapshot's), spilling past the budget as updates do."""
        if key not in self._entities and key not in self._spilled:
            self.entities_by_kind[key[0]] += 1
        self._entities[key] = entity
        entity.nbytes = 0
        self.resized(entity)

    def resized(self, entity: EntityState) -> None:
        """Account for ``entity``'s new size after an update."""
        size = entity.size()
        self.bytes += size - entity.nbytes
        entity.nbytes = size

    def evict(self) -> None:
        """Spill the least recently updated entities until the rest fit the budget."""
        while self.bytes > self.budget and len(self._entities) > 1:
            if self._spill is None:
                from rocksdict import Rdict  # the SSD tier's library (embedding/ssd.py)

                self.spill_dir.mkdir(parents=True, exist_ok=True)
                self._spill = Rdict(str(self.spill_dir))
            key, entity = self._entities.popitem(last=False)
            self._spill[f"{key[0]}/{key[1]}"] = entity.to_bytes()
            self._spilled.add(key)
            self.bytes -= entity.nbytes
            self.spills += 1

    def clear(self) -> None:
        """Forget every entity (in memory and spilled)."""
        self._entities.clear()
        self._spilled.clear()
        self.bytes = 0
        self.entities_by_kind = {e: 0 for e in ENTITIES}
        self.clear_spill()

    def clear_spill(self) -> None:
        """Close the spill and delete its directory (also an earlier run's scratch)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    def _reload(self, key: EntityKey) -> EntityState | None:
        if key not in self._spilled:
            return None
        name = f"{key[0]}/{key[1]}"
        entity = EntityState.from_bytes(self._spill[name])
        self._spilled.discard(key)
        del self._spill[name]
        self.reloads += 1
        self._entities[key] = entity
        self.bytes += entity.nbytes
        return entity
