"""One writer per model: a lease in the model store, with a fencing token.

Layout: ``<root>/<model>/leases/<token:012d>.json`` holding who holds it and until when.
The lease in force is the one with the highest token. A writer takes token T+1 by
creating that file exclusively (a hard link of a finished temp file: it fails if the
file exists, and readers never see a part), so two trainers racing for one store cannot
both win. While it writes, the holder renews its file; every commit first checks that
no higher token exists (the ``VersionWriter`` given the lease calls :meth:`WriterLease.check`),
so a writer that lost its lease (paused past expiry, then overtaken) cannot move LATEST.

A lease held by the same work directory on the same host is taken over at once: the
trainer's lock file in that directory proves the previous holder is gone (crash, kill -9),
and a restart must not wait for the lease to expire. Object stores have no exclusive
create here: the check after writing narrows the race, and the docs say so.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import pyarrow.fs as pafs

from streamrec.modelstore.store import ModelStore

log = logging.getLogger(__name__)
KEPT_LEASE_FILES = 3  # older lease files are deleted (the newest few explain recent take-overs)


class LeaseHeld(RuntimeError):
    """Another live writer holds the model store's lease."""


class LeaseLost(RuntimeError):
    """This writer's lease was taken over: it must not publish any more."""


@dataclass(frozen=True)
class LeaseRecord:
    token: int
    host: str
    pid: int
    work_dir: str
    acquired_at: float
    renewed_at: float
    ttl_s: float
    released: bool = False

    def live(self, now: float) -> bool:
        return not self.released and now < self.renewed_at + self.ttl_s

    def describe(self, now: float) -> str:
        return (f"token {self.token}, pid {self.pid} on {self.host}, work dir {self.work_dir}, renewed "
                f"{now - self.renewed_at:.0f} s ago, expires in {max(0.0, self.renewed_at + self.ttl_s - now):.0f} s")


def lease_records(store: ModelStore) -> list[LeaseRecord]:
    """Every lease file of the store, oldest token first (unreadable ones are skipped)."""
    folder = f"{store.base}/leases"
    fs = store.files.fs
    if fs.get_file_info(folder).type == pafs.FileType.NotFound:
        return []
    records = []
    for info in fs.get_file_info(pafs.FileSelector(folder)):
        stem = info.base_name.removesuffix(".json")
        if info.base_name.endswith(".json") and stem.isdigit():
            try:
                with fs.open_input_stream(info.path) as src:
                    records.append(LeaseRecord(**json.loads(src.read())))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring unreadable lease file %s: %s", info.path, exc)
    return sorted(records, key=lambda r: r.token)


class WriterLease:
    """This process's lease on ``store``: :meth:`acquire`, renewed by a thread, checked
    before every commit of the ``VersionWriter`` given it (writer.py), released on a clean exit."""

    def __init__(self, store: ModelStore, work_dir: str, ttl_s: float = 30.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"the lease time must be > 0 s, got {ttl_s}")
        self.store, self.ttl_s = store, ttl_s
        self.work_dir = os.path.abspath(work_dir)
        self.host = socket.gethostname()
        self.record: LeaseRecord | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def folder(self) -> str:
        return f"{self.store.base}/leases"

    def _path(self, token: int) -> str:
        return f"{self.folder}/{token:012d}.json"

    def acquire(self) -> "WriterLease":
        """Take the next token, or raise :class:`LeaseHeld` naming the live holder."""
        now = time.time()
        records = lease_records(self.store)
        current = records[-1] if records else None
        if current is not None and current.live(now) and (current.host, current.work_dir) != (self.host, self.work_dir):
            raise LeaseHeld(f"model store {self.store.base} is being written by another trainer ({current.describe(now)}). "
                            "One trainer per model: stop that one, or wait until its lease expires")
        token = (current.token if current else 0) + 1
        record = LeaseRecord(token, self.host, os.getpid(), self.work_dir, now, now, self.ttl_s)
        self.store.files.fs.create_dir(self.folder, recursive=True)
        if not self._create_exclusive(self._path(token), record):
            raise LeaseHeld(f"another trainer took the lease of {self.store.base} at the same moment (token {token}); "
                            "one trainer per model")
        self.record = record
        self.check()
        if current is not None and current.live(now):
            log.warning("took over the model store lease from an earlier run in this work dir (%s)", current.describe(now))
        for old in records[:-KEPT_LEASE_FILES + 1] if len(records) >= KEPT_LEASE_FILES else []:
            self.store.files.fs.delete_file(self._path(old.token))
        self._renewer = threading.Thread(target=self._renew_loop, name="store-lease", daemon=True)
        self._renewer.start()
        return self

    def _create_exclusive(self, path: str, record: LeaseRecord) -> bool:
        data = json.dumps(asdict(record)).encode()
        if self.store.files.fs.type_name != "local":  # no exclusive create: write, then check() sees a rival
            if self.store.files.fs.get_file_info(path).type != pafs.FileType.NotFound:
                return False
            with self.store.files.fs.open_output_stream(path) as out:
                out.write(data)
            return True
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as out:
            out.write(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this lease is still the store's newest."""
        if self.lost:
            raise LeaseLost(self.lost)
        if self.record is None:
            raise LeaseLost(f"this process holds no lease on {self.store.base} (never acquired, or released): "
                            "it publishes nothing")
        newest = lease_records(self.store)
        if not newest or newest[-1].token != self.record.token:
            holder = newest[-1].describe(time.time()) if newest else "no lease file at all"
            self.lost = (f"this trainer's lease on {self.store.base} (token {self.record.token}) was taken over ({holder}); "
                         "it publishes nothing more")
            raise LeaseLost(self.lost)

    def renew(self) -> None:
        """Extend the lease (the holder's own file, replaced atomically)."""
        self.check()
        self.record = LeaseRecord(**{**asdict(self.record), "renewed_at": time.time()})
        self.store.files.replace_file(self._path(self.record.token), json.dumps(asdict(self.record)).encode())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLost as exc:
                log.error("%s", exc)
                return
            except OSError as exc:  # the store is unreachable: try again; commits check the lease anyway
                log.warning("renewing the model store lease failed: %s", exc)

    def release(self) -> None:
        """Mark the lease released (kept as a record; the next writer takes the next token)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if self.record is None or self.lost:
            return
        try:
            self.check()
            released = LeaseRecord(**{**asdict(self.record), "renewed_at": time.time(), "released": True})
            self.store.files.replace_file(self._path(released.token), json.dumps(asdict(released)).encode())
        except (LeaseLost, OSError) as exc:
            log.warning("releasing the model store lease: %s", exc)
        self.record = None
