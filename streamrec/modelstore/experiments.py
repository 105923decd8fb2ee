"""Run-time experiment changes, kept in the model store so that every serving node sees them
and a restarted node keeps them (as the rollback pin is kept: ``store.py``).

Layout::

    <root>/_experiments/<name>.json    {"experiment": {...}, "at": unix time}   put at run time
                                       {"deleted": true, "at": unix time}       deleted at run time

The configuration's ``[[serving.experiments]]`` are the base; a record here overrides the one
of its name. A deletion is a tombstone rather than a missing file, so that an experiment of the
configuration stays deleted on every node and after restarts; a later put replaces it. Deleting
the file itself brings the configured experiment back.

Each file is replaced whole (a temp file renamed into place; one PUT on object stores), so a
reader sees the old record or the new one, never a part. A file this module cannot read (edited
by hand, cut short, nested too deeply) is returned as :class:`Unreadable` rather than raised:
one bad record must not keep every node from reading the others. This module does not import
``store.py``: it needs no torch, so any process may read experiments.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs

FOLDER = "_experiments"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class CorruptExperiment(ValueError):
    """A record in the store is not one this module wrote (edited by hand, another format)."""


@dataclass(frozen=True)
class Unreadable:
    """A record file that holds no record (``why``: which file and what is wrong). Every node
    reads it alike, so every node serves no experiment of its name and reports it."""

    why: str


def check_name(name: str) -> None:
    """Names become file names and URL path segments: letters, digits, ``_.-``, at most 128."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"invalid experiment name {name!r}: use 1-128 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")


class ExperimentStore:
    """The experiment records under ``<root>/_experiments`` of a ``pyarrow.fs`` root (a local
    path or a URI such as ``s3://bucket/prefix``). Store failures raise ``OSError``."""

    def __init__(self, root: str) -> None:
        self.fs, base = pafs.FileSystem.from_uri(root) if "://" in root else (pafs.LocalFileSystem(), os.path.abspath(root))
        self.folder = f"{base.rstrip('/')}/{FOLDER}"
        # S3 and GCS cannot rename; their single-object PUTs are atomic instead (as in store.py)
        self.renames = self.fs.type_name not in ("s3", "gcs")

    def put(self, name: str, experiment: dict) -> None:
        """Record ``experiment`` (its JSON form) under ``name``, replacing any earlier record."""
        self._replace(name, {"experiment": experiment, "at": time.time()})

    def delete(self, name: str) -> None:
        """Record that ``name`` is deleted (a tombstone: a configured experiment stays deleted)."""
        self._replace(name, {"deleted": True, "at": time.time()})

    def load(self) -> dict[str, dict | Unreadable | None]:
        """Every record: name -> the experiment's JSON form, None for a deleted one, or
        :class:`Unreadable`. OSError: the store (or a file in it) cannot be read now."""
        out: dict[str, dict | Unreadable | None] = {}
        for info in self.fs.get_file_info(pafs.FileSelector(self.folder, allow_not_found=True)):
            name = info.base_name.removesuffix(".json")
            if info.type != pafs.FileType.File or not info.base_name.endswith(".json") or not NAME.fullmatch(name):
                continue  # temp files of a write in progress (".<name>.json.tmp-*"), strays
            with self.fs.open_input_stream(info.path) as src:
                data = src.read()
            try:
                out[name] = _parse(info.path, data)
            except CorruptExperiment as exc:
                out[name] = Unreadable(str(exc))
        return out

    def _replace(self, name: str, record: dict) -> None:
        check_name(name)
        path = f"{self.folder}/{name}.json"
        data = json.dumps(record, sort_keys=True).encode()
        if not self.renames:
            self._write(path, data)
            return
        self.fs.create_dir(self.folder, recursive=True)
        tmp = f"{self.folder}/.{name}.json.tmp-{uuid.uuid4().hex[:8]}"
        self._write(tmp, data)
        self.fs.move(tmp, path)

    def _write(self, path: str, data: bytes) -> None:
        with self.fs.open_output_stream(path) as out:
            out.write(data)


def _parse(path: str, data: bytes) -> dict | None:
    try:
        record = json.loads(data)
    except ValueError as exc:
        raise CorruptExperiment(f"{path} is not valid JSON ({exc}): fix or delete it") from None
    except RecursionError:  # the parser's own stack: no record this module writes is nested deeper than 4
        raise CorruptExperiment(f"{path} is JSON nested too deeply to be a record: fix or delete it") from None
    if isinstance(record, dict) and record.get("deleted") is True:
        return None
    if isinstance(record, dict) and isinstance(record.get("experiment"), dict):
        return record["experiment"]
    raise CorruptExperiment(f'{path} holds neither {{"experiment": {{...}}}} nor {{"deleted": true}}: fix or delete it')
