"""The SSD tier: cold rows in RocksDB (rocksdict), one database per table.

A row is stored under its key (8 bytes, big-endian, so keys sort numerically within
sign) as one record: weights, optimizer state (float32) and the last-seen clock (int64).
Batched reads and writes; the record layout is fixed by the table's dim and state width.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from rocksdict import Options, Rdict, WriteBatch


class SsdTier:
    def __init__(self, path: Path, dim: int, state_dim: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dim, self.state_dim = dim, state_dim
        self._floats = dim + state_dim
        self.db = Rdict(str(self.path), options=Options(raw_mode=True))
        self.count = sum(1 for _ in self.db.keys())

    @staticmethod
    def _key_bytes(keys: torch.Tensor) -> list[bytes]:
        raw = keys.cpu().numpy().astype(">i8").tobytes()
        return [raw[i : i + 8] for i in range(0, len(raw), 8)]

    def put(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor) -> None:
        if len(keys) == 0:
            return
        floats = torch.cat([weights, state], dim=1).cpu().numpy().astype(np.float32)
        seen = last_seen.cpu().numpy().astype(np.int64)
        batch = WriteBatch(raw_mode=True)
        existing = self.db.get(self._key_bytes(keys))
        for key, row, t in zip(self._key_bytes(keys), floats, seen):
            batch.put(key, row.tobytes() + t.tobytes())
        self.db.write(batch)
        self.count += sum(1 for e in existing if e is None)

    def take(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read and delete the present keys; returns (keys, weights, state, last_seen) found."""
        found = self.get(keys)
        if len(found[0]):
            batch = WriteBatch(raw_mode=True)
            for key in self._key_bytes(found[0]):
                batch.delete(key)
            self.db.write(batch)
            self.count -= len(found[0])
        return found

    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(keys) == 0 or self.count == 0:
            return self._decode(keys[:0], [])
        values = self.db.get(self._key_bytes(keys))
        hit = [i for i, v in enumerate(values) if v is not None]
        return self._decode(keys.cpu()[hit], [values[i] for i in hit])

    def delete(self, keys: torch.Tensor) -> None:
        self.take(keys)

    def items(self, batch_rows: int = 65536):
        """Yield (keys, weights, state, last_seen) over everything stored, in chunks."""
        keys, values = [], []
        for k, v in self.db.items():
            keys.append(k)
            values.append(v)
            if len(keys) >= batch_rows:
                yield self._decode(self._keys_from(keys), values)
                keys, values = [], []
        if keys:
            yield self._decode(self._keys_from(keys), values)

    @staticmethod
    def _keys_from(raw: list[bytes]) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(b"".join(raw), dtype=">i8").astype(np.int64))

    def _decode(self, keys: torch.Tensor, values: list[bytes]):
        n = len(values)
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, torch.empty(0, self.dim), torch.empty(0, self.state_dim), empty
        buf = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, self._floats * 4 + 8)
        floats = torch.from_numpy(buf[:, : self._floats * 4].copy().view(np.float32))
        seen = torch.from_numpy(buf[:, self._floats * 4 :].copy().view(np.int64)[:, 0])
        return keys.to(torch.int64), floats[:, : self.dim], floats[:, self.dim :], seen

    def close(self) -> None:
        self.db.close()
