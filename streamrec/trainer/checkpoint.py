"""Trainer checkpoints: sparse tables + dense model + optimizer + source positions, as one
consistent unit.

Layout under ``<dir>``: ``ckpt-<step:012d>/{sparse/, dense.pt, state.json}`` and
``LATEST`` naming the newest. A checkpoint is written into a temp directory, renamed into
place, and only then named by ``LATEST`` (temp + rename), so a crash at any point
leaves the previous checkpoint intact and in charge. The newest ``keep`` are kept. A write
that fails (a full disk) leaves the same: what it wrote is removed, and it raises
:class:`~streamrec.trainer.local_files.WriteFailed` naming the checkpoint.

Consistency: the trainer checkpoints only between steps and never while a publish is in
flight, so the saved delta tracking, parameters and positions all describe the same
moment.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from streamrec.embedding.collection import EmbeddingCollection
from streamrec.trainer.local_files import WriteFailed


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.dir = Path(directory)
        self.keep = max(1, keep)

    def latest(self) -> Path | None:
        pointer = self.dir / "LATEST"
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        if not (path / "state.json").is_file():
            raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
        return path

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, ascending."""
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name[len("ckpt-"):]) for p in self.dir.glob("ckpt-*") if (p / "state.json").is_file())

    def at(self, step: int) -> Path:
        return self.dir / f"ckpt-{step:012d}"

    def save(self, step: int, embeddings: EmbeddingCollection, dense: dict[str, Any], state: dict[str, Any]) -> Path:
        """Write the checkpoint of ``step`` and name it in ``LATEST``; returns its path."""
        name = f"ckpt-{step:012d}"
        try:
            self._write(name, embeddings, dense, state)
        except OSError as exc:
            raise WriteFailed(self.dir / name, exc) from None
        self._name_latest(name)
        self._prune(keep_name=name)
        return self.dir / name

    def _write(self, name: str, embeddings: EmbeddingCollection, dense: dict[str, Any], state: dict[str, Any]) -> None:
        """The checkpoint's files into a temp directory, renamed to ``name`` once complete."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            embeddings.checkpoint(tmp / "sparse")
            buf = io.BytesIO()
            torch.save(dense, buf)
            (tmp / "dense.pt").write_bytes(buf.getvalue())
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
            final = self.dir / name
            if final.exists():  # same step again (e.g. a stop right after a checkpoint): swap by two
                # renames, so the name LATEST may point at is missing for microseconds, not
                # for the whole delete of the old tree
                replaced = self.dir / f".old-{name}-{uuid.uuid4().hex[:8]}"
                final.rename(replaced)
                tmp.rename(final)
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _name_latest(self, name: str) -> None:
        """Point ``LATEST`` at ``name`` (temp + rename). If that fails, a checkpoint LATEST
        does not name is removed, so the previous one stays the one a restart resumes from."""
        pointer, pointer_tmp = self.dir / "LATEST", self.dir / f".LATEST.tmp-{os.getpid()}"
        try:
            pointer_tmp.write_text(name + "\n")
            pointer_tmp.replace(pointer)
        except OSError as exc:
            with contextlib.suppress(OSError):
                pointer_tmp.unlink(missing_ok=True)
            if self._named() != name:
                shutil.rmtree(self.dir / name, ignore_errors=True)
            raise WriteFailed(pointer, exc) from None

    def _named(self) -> str | None:
        """The name ``LATEST`` holds (None: no LATEST, or unreadable)."""
        try:
            return (self.dir / "LATEST").read_text().strip()
        except OSError:
            return None

    def load(self, path: Path, device: torch.device, work_dir: Path | None) -> tuple[EmbeddingCollection, dict, dict]:
        embeddings, _ = EmbeddingCollection.restore(path / "sparse", device, work_dir)
        dense = torch.load(path / "dense.pt", map_location=device, weights_only=False)
        state = json.loads((path / "state.json").read_text())
        return embeddings, dense, state

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.dir.glob("ckpt-*") if p.is_dir())
        for old in done[: -self.keep]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)
        for tmp in [*self.dir.glob(".tmp-ckpt-*"), *self.dir.glob(".old-ckpt-*")]:  # left by a crashed writer (we hold the trainer lock)
            shutil.rmtree(tmp, ignore_errors=True)
