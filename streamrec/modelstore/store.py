"""The model store: full and delta versions of sparse tables and dense tensors.

Three parts on one model's files: :class:`StoreFiles` (files.py: the filesystem, paths,
atomic replace, listing), :class:`ModelStore` (here: LATEST, listing, pins, manifests,
chains, verification, loading, retention) and ``VersionWriter`` (writer.py: publish, the
sharded ``begin`` / ``write_shard`` / ``commit``, compaction, under the writer lease).

Layout (docs/architecture.md; the files' schemas in streamrec/contracts/delta.py)::

    <root>/<model>/versions/<version:012d>/manifest.json
                                          sparse/<table>.arrow   key int64, deleted bool, value float32[dim]
                                          sparse/<table>/<shard>-of-<n>.arrow   the same, one file per
                                                                 rank of a sharded trainer
                                          dense.arrow            name, shape, values
    <root>/<model>/compacted/<version:012d>/                     version's whole state as one full image
                                                                 (the same files and manifest as a full
                                                                 version): its chain, compacted
    <root>/<model>/LATEST                                        the newest complete version, as text
    <root>/<model>/PIN                                           an operator's pin (rollback): JSON
    <root>/<model>/leases/<token:012d>.json                      the writer lease (lease.py)

Compaction: a trainer publishing every few seconds writes small deltas and rarely a full
version, so chains grow long. ``VersionWriter.compact(v)`` merges ``v``'s chain into
``compacted/<v>``; a reader that loads ``v`` or a later version starts from the newest image
on its chain and applies only the deltas after it, and ``gc`` counts images as full
versions. Serving nodes that follow deltas in place never read an image: only a node that
starts or falls behind.

Any ``pyarrow.fs`` URI works as root (a local path, ``file://``, ``s3://``, ``hdfs://``).

Visibility: a version is written under ``versions/.tmp-*`` (manifest last), renamed into
place, and only then is ``LATEST`` replaced (temp + rename). A reader trusts a version
only when its manifest exists and every file's size and sha256 match, so a crash at any
point leaves either the previous state or the complete new version. A version whose
values are not all finite fails verification like a bad checksum: no reader serves it. Object stores (S3,
GCS) cannot rename a directory: there the files go straight into the version's directory
with the manifest last (a version without a manifest is not listed) and ``LATEST`` is
overwritten in one PUT (atomic per object).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.ipc as ipc

if TYPE_CHECKING:
    import torch

from streamrec.contracts.delta import FORMAT_VERSION, MANIFEST, sparse_arrays
from streamrec.modelstore.files import VERSION_NUMBER, StoreFiles


class CorruptVersion(RuntimeError):
    """A version is incomplete, fails its checksums, or breaks the format."""


_SHOWN_BYTES = 60  # of a file that does not parse, shown in its error


@dataclass(frozen=True)
class Pin:
    """An operator's decision to serve ``version`` whatever LATEST says, until released."""

    version: int
    by: str
    at: float
    reason: str


@dataclass
class LoadedModel:
    version: int
    manifest: dict
    tables: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (keys int64 [n], values float32 [n, dim])
    dense: dict[str, torch.Tensor]
    chain: list[int]


class ModelStore:
    """The reading side of model ``model``'s versions under ``root`` (a local path or any
    ``pyarrow.fs`` URI): LATEST, listing, pins, manifests, chains, verification, loading and
    retention. :class:`~streamrec.modelstore.writer.VersionWriter` writes versions.

    Attributes: ``files`` (:class:`StoreFiles`: the filesystem and the paths), ``model``
    (the model's name) and ``base`` (``<root>/<model>``, as error messages name it).
    """

    def __init__(self, root: str, model: str) -> None:
        self.files = StoreFiles(root, model)
        self.model, self.base = model, self.files.base

    # ------------------------------------------------------------------ listing
    def latest(self) -> int | None:
        """LATEST's version; CorruptVersion naming the file when it holds anything but one
        number in ASCII digits (any bytes, any encoding)."""
        path = f"{self.base}/LATEST"
        try:
            data = self.files.read(path)
        except (FileNotFoundError, OSError):
            return None
        text = data.strip()
        if not VERSION_NUMBER.fullmatch(text.decode("ascii", "replace")):
            raise CorruptVersion(f"{path} holds {_shown(text)}, not a version number (ASCII digits)")
        return int(text)

    def has_version(self, version: int, image: bool = False) -> bool:
        """Whether ``version`` (or its compacted image) is in the store now, manifest included."""
        return self.files.exists(f"{self.files.version_dir(version, image)}/{MANIFEST}")

    def versions(self) -> list[int]:
        """Complete versions present (those with a manifest), ascending."""
        return self.files.listed(self.files.versions_dir)

    def images(self) -> list[int]:
        """Versions with a complete compacted image, ascending."""
        return self.files.listed(self.files.compacted_dir)

    def resolve_latest(self) -> tuple[int | None, str | None]:
        """(the version readers should follow, why LATEST itself could not be used): a
        garbage or dangling LATEST falls back to the newest version with a manifest."""
        try:
            latest = self.latest()
        except CorruptVersion as exc:
            problem = str(exc)
        else:
            if latest is None or self.has_version(latest):
                return latest, None
            problem = f"{self.base}/LATEST names version {latest}, which does not exist"
        versions = self.versions()
        return (versions[-1] if versions else None), problem

    # ------------------------------------------------------------------ pins
    def pin(self, version: int, by: str, reason: str = "") -> Pin:
        """Record that every reader serves ``version`` until :meth:`unpin` (atomic)."""
        self.manifest(version)  # raises CorruptVersion for a version that is not there
        pin = Pin(version, by, time.time(), reason)
        self.files.replace_file(f"{self.base}/PIN", json.dumps(pin.__dict__).encode())
        return pin

    def unpin(self) -> Pin | None:
        """Release the pin; returns the one released (None when there was none, or when the
        PIN file did not parse: it is removed all the same, that being how to fix it)."""
        try:
            pin = self.pinned()
        except CorruptVersion:
            pin = None
        if self.files.exists(f"{self.base}/PIN"):
            self.files.fs.delete_file(f"{self.base}/PIN")
        return pin

    def pinned(self) -> Pin | None:
        """The pin in force, if any (a PIN file that does not parse raises CorruptVersion)."""
        path = f"{self.base}/PIN"
        try:
            data = self.files.read(path)
        except FileNotFoundError:
            return None
        try:
            return _parse_pin(data)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            why = {RecursionError: "nested too deeply", KeyError: f"it lacks {exc}"}.get(type(exc), str(exc))
            raise CorruptVersion(f"{path} is not a valid pin: {why} (it holds {_shown(data)}); remove it "
                                 "(streamrec store unpin, or :reload {} on a serving node) or pin a version") from None

    def manifest(self, version: int, image: bool = False) -> dict:
        path = f"{self.files.version_dir(version, image)}/{MANIFEST}"
        try:
            manifest = json.loads(self.files.read(path))
        except FileNotFoundError:
            what = "compacted image" if image else "version"
            raise CorruptVersion(f"{what} {version} of {self.model} has no manifest (incomplete or absent)") from None
        except (ValueError, RecursionError) as exc:
            raise CorruptVersion(f"{path} is not valid JSON: {'nested too deeply' if isinstance(exc, RecursionError) else exc}") from None
        if not isinstance(manifest, dict):
            raise CorruptVersion(f"{path} holds a JSON {type(manifest).__name__}, not an object")
        for key in ("format_version", "version", "kind", "parent", "files", "tables"):
            if key not in manifest:
                raise CorruptVersion(f"{path} lacks '{key}'")
        if manifest["format_version"] != FORMAT_VERSION:
            raise CorruptVersion(f"{path}: format_version {manifest['format_version']} is not supported (expected {FORMAT_VERSION})")
        _check_lineage(path, version, manifest)
        return manifest

    # ------------------------------------------------------------------ reading
    def chain(self, version: int) -> list[int]:
        """Versions to apply, oldest first: the nearest full version or compacted image at or
        before ``version`` (``load`` reads the first one's image when it has one), then deltas."""
        return self._chain(version)[1]

    def load_plan(self, version: int) -> tuple[bool, list[int]]:
        """What :meth:`load` reads for ``version``: (whether the first of the chain is read
        from its compacted image, the chain oldest first)."""
        return self._chain(version)

    def _chain(self, version: int) -> tuple[bool, list[int]]:
        """Walk parents down to a full version or an image. The walk ends: :meth:`manifest`
        refuses a delta whose parent is not an earlier version, so no chain can loop."""
        images = set(self.images())
        out = [version]
        if version in images:
            return True, out
        manifest = self.manifest(version)
        while manifest["kind"] == "delta":
            parent = manifest["parent"]
            if parent is None:
                raise CorruptVersion(f"delta version {manifest['version']} has no parent")
            out.append(parent)
            if parent in images:
                return True, out[::-1]
            manifest = self.manifest(parent)
        return False, out[::-1]

    def check_present(self, version: int) -> None:
        """Raise CorruptVersion unless every file ``version``'s chain needs is there at its
        recorded size: what a node starting now would read (a pin to a version that fails this
        would strand every node). Sizes only: ``read_version`` checks contents as it loads."""
        from_image, chain = self._chain(version)
        for i, v in enumerate(chain):
            image = from_image and i == 0
            manifest, vdir = self.manifest(v, image), self.files.version_dir(v, image)
            for rel, info in manifest["files"].items():
                found = self.files.fs.get_file_info(f"{vdir}/{rel}")
                what = f"version {version} needs version {v}, whose" if v != version else f"version {version}:"
                if found.type == pafs.FileType.NotFound:
                    raise CorruptVersion(f"{what} {rel} is missing")
                if found.size != info["bytes"]:
                    raise CorruptVersion(f"{what} {rel} has {found.size} bytes, its manifest says {info['bytes']}")

    def read_version(self, version: int, image: bool = False) -> tuple[dict, dict[str, pa.Table], dict[str, torch.Tensor]]:
        """One version's files (or its compacted image's), verified: (manifest, sparse tables, dense tensors)."""
        import torch  # here, not at the top: the store tools (`streamrec store`) start without it

        manifest, sparse, dense = self.check_version(version, image)
        return manifest, sparse, {name: torch.from_numpy(values) for name, values in dense.items()}

    def check_version(self, version: int, image: bool = False) -> tuple[dict, dict[str, pa.Table], dict[str, np.ndarray]]:
        """One version's files (or its compacted image's), verified: (manifest, sparse tables, dense
        arrays). Raises CorruptVersion naming the first file that fails."""
        manifest = self.manifest(version, image)
        vdir = self.files.version_dir(version, image)
        sparse: dict[str, pa.Table] = {}
        shards: dict[str, list[pa.Table]] = {}
        dense: dict[str, np.ndarray] = {}
        for rel, info in manifest["files"].items():
            try:
                data = self.files.read(f"{vdir}/{rel}")
            except FileNotFoundError:
                raise CorruptVersion(f"version {version}: {rel} is missing") from None
            if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise CorruptVersion(f"version {version}: {rel} fails its checksum (expected sha256 {info['sha256']}, {info['bytes']} bytes)")
            try:
                table = ipc.open_file(pa.BufferReader(data)).read_all()
            except pa.ArrowInvalid as exc:
                raise CorruptVersion(f"version {version}: {rel} is not an Arrow file: {exc}") from None
            if table.num_rows != info["rows"]:
                raise CorruptVersion(f"version {version}: {rel} has {table.num_rows} rows, manifest says {info['rows']}")
            if rel == "dense.arrow":
                for name, shape, values in zip(table["name"].to_pylist(), table["shape"].to_pylist(), table["values"].to_numpy(zero_copy_only=False)):
                    dense[name] = np.asarray(values, dtype=np.float32).copy().reshape(shape)
                    if not np.isfinite(dense[name]).all():
                        raise CorruptVersion(f"version {version}: dense parameter {name} holds non-finite values")
            else:  # a table's shards (disjoint keys) read as one table
                if table.num_rows and not _all_finite(table["value"]):
                    raise CorruptVersion(f"version {version}: {rel} holds non-finite embedding values")
                shards.setdefault(info.get("table") or rel[len("sparse/") : -len(".arrow")], []).append(table)
        for name, parts in shards.items():
            if name not in manifest["tables"]:
                raise CorruptVersion(f"version {version}: files of table {name!r}, which the manifest's tables do not list")
            sparse[name] = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        return manifest, sparse, dense

    def load(self, version: int | None = None) -> LoadedModel:
        """Materialise a version: its full ancestor plus every delta after it, verified."""
        version = self.latest() if version is None else version
        if version is None:
            raise CorruptVersion(f"model {self.model} has no published version under {self.base}")
        from_image, chain = self._chain(version)
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        dims: dict[str, int] = {}
        dense: dict[str, torch.Tensor] = {}
        manifest: dict = {}
        for i, v in enumerate(chain):
            manifest, sparse, dense_v = self.read_version(v, image=from_image and i == 0)
            dense.update(dense_v)
            for name, table in sparse.items():
                dims[name] = manifest["tables"][name]["dim"]
                parts.setdefault(name, []).append(sparse_arrays(table, dims[name]))
        tables = {name: _merge(chunks, dims[name]) for name, chunks in parts.items()}
        if from_image and len(chain) == 1:  # the version's own manifest (its kind, parent, times), not the image's
            try:
                manifest = self.manifest(version)
            except CorruptVersion:
                pass  # garbage-collected: the image carries its metadata
        return LoadedModel(version, manifest, tables, dense, chain)

    # ------------------------------------------------------------------ retention
    def gc(self, keep_fulls: int = 2) -> list[int]:
        """Delete versions older than the ``keep_fulls``-th newest full version (and stale
        temp dirs); everything needed to load any kept version stays. Returns deleted versions."""
        versions, images = self.versions(), self.images()
        fulls = sorted({v for v in versions if self.manifest(v)["kind"] == "full"} | set(images))  # where a chain can start
        if len(fulls) <= keep_fulls:
            return []
        horizon = fulls[-keep_fulls]
        try:
            pin = self.pinned()
        except CorruptVersion:  # which versions a pin needs is unknown: delete nothing until it is fixed
            return []
        pinned = set(self.chain(pin.version)) if pin is not None and pin.version in versions else set()  # these stay
        doomed = [v for v in versions if v < horizon and v not in pinned]
        for v in doomed:
            self.files.fs.delete_dir(self.files.version_dir(v))
        for info in [*self.files.fs.get_file_info(pafs.FileSelector(self.files.versions_dir)),
                     *self.files.fs.get_file_info(pafs.FileSelector(self.files.compacted_dir, allow_not_found=True))]:
            if info.base_name.startswith(".tmp-") and info.mtime and time.time() - info.mtime.timestamp() > 3600:
                self.files.fs.delete_dir(info.path)  # left by a crashed writer over an hour ago
            elif VERSION_NUMBER.fullmatch(info.base_name) and int(info.base_name) < horizon and int(info.base_name) not in pinned \
                    and info.type == pafs.FileType.Directory:
                self.files.fs.delete_dir(info.path)  # an image behind the horizon, or a version without a manifest (a crashed writer's, on an object store)
        return doomed


def _shown(data: bytes) -> str:
    """A file's bytes as an error shows them: the text when it is UTF-8, else the bytes."""
    head = data[:_SHOWN_BYTES]
    try:
        shown = repr(head.decode())
    except UnicodeDecodeError:
        shown = repr(head)
    return shown if len(data) <= _SHOWN_BYTES else f"{shown}... ({len(data)} bytes)"


def _parse_pin(data: bytes) -> Pin:
    """A PIN file's pin; ValueError, KeyError or TypeError saying what is wrong."""
    fields = json.loads(data)
    if not isinstance(fields, dict):
        raise TypeError(f"a JSON {type(fields).__name__}, not an object")
    version = fields["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"'version' is {version!r}, not a version number")
    return Pin(version, str(fields["by"]), float(fields["at"]), str(fields.get("reason", "")))


def _check_lineage(path: str, version: int, manifest: dict) -> None:
    """A manifest's kind, and a delta's parent: an earlier version, so that every chain ends."""
    kind, parent = manifest["kind"], manifest["parent"]
    if kind not in ("full", "delta"):
        raise CorruptVersion(f"{path}: kind {kind!r} is neither 'full' nor 'delta'")
    if kind == "delta" and parent is not None:
        if isinstance(parent, bool) or not isinstance(parent, int) or not 1 <= parent < version:
            raise CorruptVersion(f"{path}: a delta's parent must be an earlier version than {version}, not {parent!r} "
                                 "(its chain would loop or leave the store)")
    if not isinstance(manifest["files"], dict) or not isinstance(manifest["tables"], dict):
        raise CorruptVersion(f"{path}: 'files' and 'tables' must be JSON objects")
    for rel, info in manifest["files"].items():
        if not isinstance(info, dict) or not all(key in info for key in ("sha256", "bytes", "rows")):
            raise CorruptVersion(f"{path}: the entry of {rel} lacks its sha256, bytes or rows")


def _all_finite(values: pa.ChunkedArray) -> bool:
    flat = pa.chunked_array([chunk.flatten() for chunk in values.chunks], pa.float32())
    return bool(pc.all(pc.is_finite(flat)).as_py() is not False)


def _merge(chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Last write wins across the chain; deleted keys disappear."""
    keys = np.concatenate([c[0] for c in chunks]) if chunks else np.empty(0, np.int64)
    deleted = np.concatenate([c[1] for c in chunks]) if chunks else np.empty(0, bool)
    values = np.concatenate([c[2] for c in chunks]) if chunks else np.empty((0, dim), np.float32)
    # np.unique returns the first occurrence: look at the reversed arrays to get the last.
    _, first_in_reversed = np.unique(keys[::-1], return_index=True)
    last = len(keys) - 1 - first_in_reversed
    last = last[~deleted[last]]
    last.sort()
    return keys[last], values[last]

