"""The SSD tier: cold rows in RocksDB (rocksdict), one database per table.

Three column families, changed together in one atomic WriteBatch per call:
- ``default``: the rows. Key: the row's key, 8 bytes big-endian. Value: weights and
  optimizer state (float32), then the last-seen clock (int64).
- ``by_time`` (tables that expire rows): one empty record per row under (last-seen clock,
  key), the clock with its sign bit flipped so that byte order is time order. Expiry reads
  this family up to the cutoff, so it touches only the rows that expire, never the whole
  database. A table without expiry does not pay for it (half the writes).
- ``meta``: the row count, kept in step with the rows, so opening the tier reads one key
  instead of counting them all; and whether the tier keeps ``by_time``.

Calls take unique keys and work in slices of ``SLICE`` rows (one multi-get, one
WriteBatch each), so the Python objects of a call stay bounded however many rows it
moves. The record layout is fixed by the table's dim and state width. ``close`` flushes
the memtables, so reopening replays no log.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from rocksdict import BlockBasedOptions, DBCompressionType, Options, ReadOptions, Rdict, WriteBatch

ROWS, BY_TIME, META = "default", "by_time", "meta"
COUNT, KEEPS_BY_TIME = b"count", b"keeps_by_time"
SLICE = 16384
_SIGN = np.uint64(1 << 63)


class SsdTier:
    def __init__(self, path: Path, dim: int, state_dim: int, by_time: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dim, self.state_dim = dim, state_dim
        self._floats = dim + state_dim
        fresh = not (self.path / "CURRENT").exists()
        if not fresh and META not in Rdict.list_cf(str(self.path), Options(raw_mode=True)):
            raise ValueError(f"{self.path} is an SSD tier without a row count (an older layout); delete it: "
                             "tiers are rebuilt from checkpoints")
        self.db = Rdict(str(self.path), options=_options(ROWS),
                        column_families={BY_TIME: _options(BY_TIME), META: _options(META)})
        self._by_time = self.db.get_column_family(BY_TIME)
        self._meta = self.db.get_column_family(META)
        self._by_time_cf = self.db.get_column_family_handle(BY_TIME)
        self._meta_cf = self.db.get_column_family_handle(META)
        count, keeps = self._meta.get(COUNT), self._meta.get(KEEPS_BY_TIME)
        if keeps is None:
            self._meta[KEEPS_BY_TIME] = bytes([by_time])
        elif keeps != bytes([by_time]):
            kept, wanted = ("with", "without") if keeps == b"\x01" else ("without", "with")
            raise ValueError(f"{self.path} was written {kept} a time index for expiry and is opened {wanted}: "
                             "delete it (tiers are rebuilt from checkpoints)")
        self.by_time = by_time
        self.count = 0 if count is None else int(np.frombuffer(count, dtype="<i8")[0])

    # ------------------------------------------------------------------ encoding
    @staticmethod
    def _key_bytes(keys: torch.Tensor) -> list[bytes]:
        raw = keys.cpu().numpy().astype(">i8").tobytes()
        return [raw[i : i + 8] for i in range(0, len(raw), 8)]

    @staticmethod
    def _time_keys(keys: torch.Tensor, last_seen: torch.Tensor) -> list[bytes]:
        """``by_time`` keys: clock (sign-flipped, big-endian) then key, 16 bytes each."""
        out = np.empty((len(keys), 2), dtype=">u8")
        out[:, 0] = last_seen.cpu().numpy().astype(np.int64).view(np.uint64) ^ _SIGN
        out[:, 1] = keys.cpu().numpy().astype(np.int64).view(np.uint64)
        raw = out.tobytes()
        return [raw[i : i + 16] for i in range(0, len(raw), 16)]

    @staticmethod
    def _time_bound(last_seen: int) -> bytes:
        return ((last_seen + (1 << 63)) % (1 << 64)).to_bytes(8, "big")  # the sign flip of _time_keys

    def _records(self, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor) -> list[bytes]:
        n = len(last_seen)
        buf = np.empty((n, self._floats * 4 + 8), dtype=np.uint8)
        buf[:, : self._floats * 4] = torch.cat([weights, state], dim=1).cpu().float().numpy().view(np.uint8)
        buf[:, self._floats * 4 :] = last_seen.cpu().numpy().astype(np.int64).reshape(n, 1).view(np.uint8)
        raw, size = buf.tobytes(), buf.shape[1]
        return [raw[i : i + size] for i in range(0, len(raw), size)]

    def _write(self, batch: WriteBatch, count: int) -> None:
        """Apply ``batch`` with the new row ``count`` in the same atomic write."""
        batch.put(COUNT, np.array([count], dtype="<i8").tobytes(), self._meta_cf)
        self.db.write(batch)
        self.count = count

    # ------------------------------------------------------------------ rows
    def put(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor,
            absent: bool = False) -> None:
        """Insert or overwrite rows. ``absent``: the caller knows no key is stored (a DRAM
        spill: a row lives in one tier at a time), which saves reading them first."""
        for lo in range(0, len(keys), SLICE):
            part = slice(lo, lo + SLICE)
            self._put(keys[part], weights[part], state[part], last_seen[part], absent)

    def _put(self, keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, last_seen: torch.Tensor, absent: bool) -> None:
        old = self._get(keys[:0] if absent else keys)  # overwritten rows: their old by_time records go
        batch = WriteBatch(raw_mode=True)
        records = zip(self._key_bytes(keys), self._records(weights, state, last_seen))
        if self.by_time:
            for stale in self._time_keys(old[0], old[3]):
                batch.delete(stale, self._by_time_cf)
            for (key, record), by_time in zip(records, self._time_keys(keys, last_seen)):
                batch.put(key, record)
                batch.put(by_time, b"", self._by_time_cf)
        else:
            for key, record in records:
                batch.put(key, record)
        self._write(batch, self.count + len(keys) - len(old[0]))

    def take(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read and delete the present keys; returns (keys, weights, state, last_seen)
        found, in request order."""
        return self._concat([self._take(keys[lo : lo + SLICE]) for lo in range(0, len(keys), SLICE)])

    def _take(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        found = self._get(keys)
        if len(found[0]):
            batch = WriteBatch(raw_mode=True)
            for key in self._key_bytes(found[0]):
                batch.delete(key)
            if self.by_time:
                for by_time in self._time_keys(found[0], found[3]):
                    batch.delete(by_time, self._by_time_cf)
            self._write(batch, self.count - len(found[0]))
        return found

    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, weights, state, last_seen) of the present keys, in request order."""
        return self._concat([self._get(keys[lo : lo + SLICE]) for lo in range(0, len(keys), SLICE)])

    def _get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(keys) == 0 or self.count == 0:
            return self._decode(keys[:0], [])
        values = self.db.get(self._key_bytes(keys))
        hit = [i for i, v in enumerate(values) if v is not None]
        return self._decode(keys.cpu()[hit], [values[i] for i in hit])

    def _concat(self, parts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return self._decode(torch.empty(0, dtype=torch.int64), [])
        return tuple(torch.cat([p[i] for p in parts]) for i in range(4))

    def delete(self, keys: torch.Tensor) -> None:
        """Delete the present keys (a key given twice counts once)."""
        self.take(torch.unique(keys))

    def expire(self, cutoff: int, batch_rows: int = 65536) -> torch.Tensor:
        """Delete the rows last seen before ``cutoff``; returns their keys. Reads only the
        ``by_time`` records below the cutoff (and drops them with one range delete per
        chunk, so later scans skip them cheaply)."""
        if not self.by_time:
            raise RuntimeError(f"{self.path} keeps no time index: open it with by_time=True to expire rows")
        bound = ReadOptions()
        bound.set_iterate_upper_bound(self._time_bound(cutoff))
        expired, chunk = [], []
        for by_time in self._by_time.keys(read_opt=bound):
            chunk.append(by_time)
            if len(chunk) >= batch_rows:
                expired.append(self._drop(chunk))
                chunk = []
        if chunk:
            expired.append(self._drop(chunk))
        return torch.cat(expired) if expired else torch.empty(0, dtype=torch.int64)

    def _drop(self, by_time: list[bytes]) -> torch.Tensor:
        """Delete the rows of consecutive ``by_time`` records (and the records)."""
        batch = WriteBatch(raw_mode=True)
        for record in by_time:
            batch.delete(record[8:])
        batch.delete_range(by_time[0], by_time[-1] + b"\x00", self._by_time_cf)
        self._write(batch, self.count - len(by_time))
        return self._keys_from([record[8:] for record in by_time])

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
        for family in (self.db, self._by_time, self._meta):
            family.flush()
        self._by_time.close()
        self._meta.close()
        del self._by_time_cf, self._meta_cf
        self.db.close()


def _options(family: str) -> Options:
    """Row lookups are point reads, mostly of keys not on SSD (new keys are looked for
    here first): a bloom filter answers those without touching disk. ``by_time`` is only
    scanned in order, so it has none. Write buffers are sized so the memtables stay a
    small part of a DRAM budget (64 MiB each by default, two per family)."""
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.set_write_buffer_size({ROWS: 32 << 20, BY_TIME: 16 << 20, META: 1 << 20}[family])
    if family == ROWS:
        options.set_compression_type(DBCompressionType.none())
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        options.set_block_based_table_factory(table)
    return options
