"""A collection's checkpoint directory: every row of every tier with its optimizer state
and clock (``<table>.arrow``), the delta tracking not yet published, the admission sketch
and the init stream (``<table>.tracking.npz``), and the table configs (``checkpoint.json``).
Everything needed to resume exactly; written atomically (temp dir + rename)."""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from streamrec.embedding.table import EmbeddingTable, TableConfig

CHECKPOINT_FORMAT = 1


def write_checkpoint(tables: dict[str, EmbeddingTable], path: Path, extra: Mapping[str, Any] | None) -> Path:
    """Write a complete checkpoint directory of ``tables`` atomically (temp dir + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, table in tables.items():
        _write_rows(tmp / f"{name}.arrow", table)
        touched, deleted = table.tracking.tracked()
        tracking = {"touched": touched.numpy(), "deleted": deleted.numpy()}
        tracking["init_rng"] = table.generator.get_state().numpy()  # new rows resume the same init stream
        if table.sketch is not None:
            tracking["sketch"] = table.sketch.counts.cpu().numpy()
        # through memory: np.savez leaves a file it cannot finish (a full disk) open, to fail again when collected
        buf = io.BytesIO()
        np.savez(buf, **tracking)
        (tmp / f"{name}.tracking.npz").write_bytes(buf.getvalue())
    meta = {"format": CHECKPOINT_FORMAT, "tables": [asdict(t.config) for t in tables.values()], "extra": dict(extra or {})}
    (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2))
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)
    return path


def read_configs(path: Path) -> tuple[list[TableConfig], dict]:
    """The table configs and the caller's ``extra`` of the checkpoint at ``path``."""
    path = Path(path)
    try:
        meta = json.loads((path / "checkpoint.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no checkpoint.json)") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not supported")
    return [TableConfig(**c) for c in meta["tables"]], meta["extra"]


def read_checkpoint(tables: dict[str, EmbeddingTable], path: Path) -> None:
    """Load the checkpoint at ``path`` into fresh ``tables`` (built from ``read_configs``)."""
    path = Path(path)
    for name, table in tables.items():
        _read_rows(path / f"{name}.arrow", table)
        tracking = np.load(path / f"{name}.tracking.npz")
        table.tracking.set_tracked(torch.from_numpy(tracking["touched"]), torch.from_numpy(tracking["deleted"]))
        table.generator.set_state(torch.from_numpy(tracking["init_rng"]))
        if table.sketch is not None and "sketch" in tracking:
            table.sketch.counts.copy_(torch.from_numpy(tracking["sketch"]))


def _row_schema(table: EmbeddingTable) -> pa.Schema:
    return pa.schema([("key", pa.int64()), ("weight", pa.list_(pa.float32(), table.config.dim)),
                      ("state", pa.list_(pa.float32(), table.state_dim)), ("last_seen", pa.int64())])


def _write_rows(path: Path, table: EmbeddingTable) -> None:
    """Every row of ``table`` as Arrow IPC, one record batch per chunk of ``export_all``:
    memory holds one chunk, not the table."""
    schema = _row_schema(table)
    with ipc.new_file(str(path), schema) as writer:
        for k, w, s, t in table.export_all(with_state=True):
            writer.write_batch(pa.record_batch([
                pa.array(k.numpy()),
                pa.FixedSizeListArray.from_arrays(pa.array(w.float().reshape(-1).numpy()), table.config.dim),
                pa.FixedSizeListArray.from_arrays(pa.array(s.float().reshape(-1).numpy()), table.state_dim),
                pa.array(t.numpy()),
            ], schema=schema))


def _read_rows(path: Path, table: EmbeddingTable) -> None:
    """Load the rows of a ``_write_rows`` file into a fresh ``table`` one record batch at a
    time: each ``get_batch`` reads that batch from the file, so memory holds one batch.
    A checkpoint lists each key once, so every row is new to the table."""
    with pa.OSFile(str(path)) as source:
        reader = ipc.open_file(source)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            n = batch.num_rows
            if n == 0:
                continue
            w = batch.column("weight").flatten().to_numpy().reshape(n, table.config.dim)
            s = batch.column("state").flatten().to_numpy().reshape(n, table.state_dim)
            table.load_rows(torch.from_numpy(batch.column("key").to_numpy().copy()), torch.from_numpy(w.copy()),
                            torch.from_numpy(s.copy()), torch.from_numpy(batch.column("last_seen").to_numpy().copy()), new=True)
