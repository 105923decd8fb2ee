"""Writing versions into the model store: :class:`VersionWriter`. The layout, and the order
of writes that makes a version visible all at once, are in store.py's module docstring.

Arguments, everywhere below:

- ``kind``: ``"full"`` (every row) or ``"delta"`` (rows changed since ``parent``, plus deleted keys);
- ``tables``: table name -> :class:`SparseDelta` (upserted keys ``[n]``, their values ``[n, dim]``,
  deleted keys ``[m]``; tensors on any device, written as int64 and float32);
- ``dims``: table name -> embedding width, for every table in ``tables``;
- ``dense``: parameter name -> tensor (the dense model's state dict), or None;
- ``meta``: extra JSON-able manifest keys (feature and model specs, offsets, counters);
- ``files``: a shard's manifest entries, as :meth:`VersionWriter.write_shard` returns them.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import pyarrow as pa
import pyarrow.ipc as ipc

from streamrec.contracts.delta import FORMAT_VERSION, MANIFEST, SparseDelta, dense_table, sparse_table
from streamrec.modelstore.store import CorruptVersion, ModelStore

if TYPE_CHECKING:
    import torch


class Lease(Protocol):
    """What a commit needs from a writer lease (lease.py): raise if it was lost."""

    def check(self) -> None: ...


@dataclass(frozen=True)
class StagedVersion:
    """A version being written: its number, kind, parent, and where its files go until
    the commit makes it visible."""

    version: int
    kind: str
    parent: int | None
    staging: str


class VersionWriter:
    """Writes versions of ``store``'s model. With a ``lease`` (lease.py's :class:`WriterLease`),
    every commit first checks it is still the store's newest, so a writer that lost it
    (fenced) moves nothing; without one, nothing is checked (tools, tests, the demo's copy)."""

    def __init__(self, store: ModelStore, lease: Lease | None = None) -> None:
        self.store, self.files, self.lease = store, store.files, lease

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def publish(
        self,
        kind: str,
        tables: Mapping[str, SparseDelta],
        dims: Mapping[str, int],
        dense: Mapping[str, torch.Tensor] | None = None,
        meta: Mapping[str, Any] | None = None,
        parent: int | None = None,
    ) -> int:
        """Write a complete version atomically and move LATEST to it; returns its number.

        A delta's ``parent`` defaults to the current LATEST. One writer, one shard: the
        sharded trainer uses ``begin`` / ``write_shard`` / ``commit`` instead.
        """
        staged = self.begin(kind, parent)
        files = self.write_shard(staged, tables, dims)
        return self.commit(staged, files, dense, meta)

    def begin(self, kind: str, parent: int | None = None) -> StagedVersion:
        """Fix the number, parent and staging directory of the next version (the writer's
        rank 0 does this and hands the result to every shard's writer). A delta holds the
        rows changed since ``parent``, the writer's previous version: it is refused unless
        LATEST is that version (a delta over anything else would mix two histories)."""
        if kind not in ("full", "delta"):
            raise ValueError(f"kind must be 'full' or 'delta', got {kind!r}")
        if kind == "delta":
            latest, _ = self.store.resolve_latest()  # a garbage LATEST over the writer's own newest version is repaired by the commit
            if latest is None:
                raise ValueError("a delta needs a parent: publish a full version first")
            if parent is not None and latest != parent:
                raise CorruptVersion(f"LATEST is version {latest}, not {parent}, the version this delta was built on")
            parent = latest
        version = max([parent or 0, *self.store.versions()]) + 1
        return StagedVersion(version, kind, parent if kind == "delta" else None, self.files.staging_dir(version))

    def write_shard(self, staged: StagedVersion, tables: Mapping[str, SparseDelta], dims: Mapping[str, int],
                    shard: int = 0, shards: int = 1) -> dict[str, dict]:
        """Write one shard's sparse files into ``staged``; returns their manifest entries.
        One shard: ``sparse/<table>.arrow``; several: ``sparse/<table>/<shard>-of-<shards>.arrow``
        (readers concatenate a table's shards by the entries' ``table``)."""
        fs = self.files.fs
        fs.create_dir(f"{staged.staging}/sparse", recursive=True)
        files: dict[str, dict] = {}
        for name, delta in tables.items():
            data = _ipc_bytes(sparse_table(delta, dims[name]))
            rel = f"sparse/{name}.arrow" if shards == 1 else f"sparse/{name}/{shard:05d}-of-{shards:05d}.arrow"
            if shards > 1:
                fs.create_dir(f"{staged.staging}/sparse/{name}", recursive=True)
            self.files.write(f"{staged.staging}/{rel}", data)
            files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "rows": len(delta.keys) + len(delta.deleted),
                          "table": name, "dim": dims[name], "upserts": len(delta.keys), "deleted": len(delta.deleted)}
        return files

    def commit(self, staged: StagedVersion, files: Mapping[str, dict], dense: Mapping[str, torch.Tensor] | None = None,
               meta: Mapping[str, Any] | None = None) -> int:
        """Write the dense file and the manifest (listing every shard's ``files``), make the
        version visible and move LATEST to it; returns the version."""
        self._seal(staged, files, dense, meta)
        latest = f"{self.files.base}/LATEST"
        if not self.files.renames_dirs:
            self.files.write(latest, f"{staged.version}\n".encode())
            return staged.version
        self._check_lease()
        self.files.fs.move(staged.staging, self.files.version_dir(staged.version))
        self.files.replace_file(latest, f"{staged.version}\n".encode())
        return staged.version

    def _seal(self, staged: StagedVersion, files: Mapping[str, dict], dense: Mapping[str, torch.Tensor] | None,
              meta: Mapping[str, Any] | None) -> None:
        """Write the dense file and the manifest into the staging directory (the manifest last:
        on an object store, where the staging directory is the final one, it is the commit)."""
        files = {rel: dict(info) for rel, info in files.items()}
        table_info: dict[str, dict] = {}
        for info in files.values():
            entry = table_info.setdefault(info["table"], {"dim": info.pop("dim"), "upserts": 0, "deleted": 0})
            entry["upserts"] += info.pop("upserts")
            entry["deleted"] += info.pop("deleted")
        if dense:
            data = _ipc_bytes(dense_table(dense))
            self.files.write(f"{staged.staging}/dense.arrow", data)
            files["dense.arrow"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "rows": len(dense)}
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": self.files.model,
            "version": staged.version,
            "kind": staged.kind,
            "parent": staged.parent,
            "created_at": time.time(),
            "files": files,
            "tables": table_info,
            **dict(meta or {}),
        }
        self.files.fs.create_dir(staged.staging, recursive=True)
        if not self.files.renames_dirs:
            self._check_lease()
        self.files.write(f"{staged.staging}/{MANIFEST}", json.dumps(manifest, indent=2).encode())

    def compact(self, version: int) -> int:
        """Write ``compacted/<version>``: ``version``'s whole state (its chain merged, from the
        newest image on it) as one full image, with ``version``'s manifest metadata. Returns
        the rows written. Atomic like a version; a writer that lost its lease writes nothing."""
        loaded = self.store.load(version)
        if len(loaded.chain) == 1:
            return 0  # a full version, or an image already: nothing to merge
        skip = {"format_version", "model", "version", "kind", "parent", "created_at", "files", "tables"}
        meta = {k: v for k, v in loaded.manifest.items() if k not in skip}
        meta.update({"image_of": version, "compacted_chain": loaded.chain, "version_created_at": loaded.manifest["created_at"]})
        staged = StagedVersion(version, "full", None, self.files.staging_dir(version, image=True))
        dims = {name: loaded.manifest["tables"][name]["dim"] for name in loaded.tables}
        import torch

        tables = {name: SparseDelta(torch.from_numpy(keys), torch.from_numpy(values)) for name, (keys, values) in loaded.tables.items()}
        self._seal(staged, self.write_shard(staged, tables, dims), loaded.dense, meta)
        if self.files.renames_dirs:
            self._check_lease()
            self.files.fs.move(staged.staging, self.files.version_dir(version, image=True))
        return sum(len(keys) for keys, _ in loaded.tables.values())

    def abort(self, staged: StagedVersion) -> None:
        """Delete a staged version that will not be committed (nothing reads it)."""
        if self.files.exists(staged.staging) and not self.files.exists(f"{staged.staging}/{MANIFEST}"):
            self.files.fs.delete_dir(staged.staging)


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()
