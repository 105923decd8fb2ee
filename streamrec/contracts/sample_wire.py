"""Samples on the wire: the Kafka encoding of ``streamrec.samples`` and the checks every
consumer applies before trusting a sample.

Encoding (schema version 1): one JSON object per Kafka message, keys = the column names
of :meth:`feature_spec.FeatureSpec.schema`, lists as JSON arrays, a null ``click_ts``
for negatives. The streaming job's encoder (``SampleJson.java``) writes the same objects,
so the job and the offline tools produce samples that decode to identical rows.

Decoding is strict and batched: a block of messages goes through pyarrow's JSON reader
with the explicit schema (C++; a float where an int belongs, an out-of-range number or a
string where a number belongs is an error, never a silent cast). Only when a block fails
is it re-read message by message to find the bad ones, so a poisoned message costs the
block some speed and loses nothing else.
"""

from __future__ import annotations

import io
import re
from typing import Sequence

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from streamrec.contracts.feature_spec import ID_COLUMNS, INSTANCE_FIELDS, REQUIRED_SAMPLE_FIELDS, SAMPLE_VERSION, FeatureSpec

RESERVED_IDS = (-(2**63), -(2**63) + 1)  # the embedding hash index's markers: cannot be keys
RESERVED_MAX = max(RESERVED_IDS)  # they are the lowest int64s: an id is reserved iff it is <= this
# Bounds of what a predict instance's client controls (the job's samples come from events
# that passed the event contract): a string as long as the body allows costs memory and
# hashing for nothing, and an hour or a position out of range means nothing.
MAX_DEVICE_CHARS = 256  # a device name is a short label (predict by ids bounds it too)
MAX_ID_CHARS = 256  # event_id, request_id: identifiers, not text
INSTANCE_MAX_CHARS = {"device": MAX_DEVICE_CHARS, "event_id": MAX_ID_CHARS, "request_id": MAX_ID_CHARS}
INSTANCE_RANGES = {"local_hour": (0, 23), "position": (0, 2**31 - 1)}  # as predict by ids (and the event contract, the hour)


def encode_samples(table: pa.Table) -> list[bytes]:
    """One JSON message per sample row."""
    return [orjson.dumps(row) for row in table.to_pylist()]


def decode_samples(values: Sequence[bytes], spec: FeatureSpec,
                   instances: bool = False) -> tuple[pa.Table, np.ndarray, list[tuple[int, str]]]:
    """Decode and check a block of messages (``instances``: predict instances, no label).

    Returns (good rows as a table of ``spec.schema()``, the input index of each good row,
    [(input index, reason)] for every rejected message).
    """
    schema = spec.schema(with_label=not instances)
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    lines = [_one_line(v) for v in values]
    rejected = [(i, "malformed_json") for i, line in enumerate(lines) if line is None]
    candidates = [i for i, line in enumerate(lines) if line is not None]
    parts: list[tuple[list[int], pa.Table]] = []
    _read_bisecting(candidates, lines, options, parts, rejected)
    table = pa.concat_tables([t for _, t in parts]) if parts else schema.empty_table()
    index = np.array([i for idx, _ in parts for i in idx], dtype=np.int64)
    good, reasons = check_samples(table, spec, instances)
    rejected.extend((int(index[i]), reason) for i, reason in reasons)
    return table.filter(pa.array(good)), index[good], sorted(rejected)


def check_samples(table: pa.Table, spec: FeatureSpec, instances: bool = False) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Semantic checks of typed samples: (good-row mask, [(row, reason)] of the others).

    A sample is refused for an unknown ``sample_version``, a missing required field, a
    label other than 0/1, a negative counter, an id equal to a reserved key, or a
    behaviour history that is longer than ``history_len`` or whose two lists disagree;
    an instance also for a string or a number past :data:`INSTANCE_MAX_CHARS` or
    :data:`INSTANCE_RANGES`.
    """
    required = INSTANCE_FIELDS if instances else REQUIRED_SAMPLE_FIELDS
    missing = [c for c in (*required, *spec.counter_columns()) if c not in table.column_names]
    if missing:
        raise ValueError(f"samples lack columns {missing}: not sample schema v{SAMPLE_VERSION} with spec {spec}")
    n = table.num_rows
    failed: list[tuple[np.ndarray, str]] = []  # (rows, reason) in the order the reasons rank

    def flag(mask: np.ndarray, why: str) -> None:
        if mask.any():
            failed.append((mask, why))

    def nulls(name: str) -> np.ndarray:
        column = table[name]
        return _np(pc.is_null(column)) if column.null_count else np.zeros(n, dtype=bool)

    version_missing = nulls("sample_version") if not instances else np.zeros(n, dtype=bool)
    flag(_np(pc.not_equal(table["sample_version"], SAMPLE_VERSION)) | version_missing, "unknown_sample_version")
    for name in required:
        flag(nulls(name), f"missing_field:{name}")
    for name in spec.counter_columns():
        flag(nulls(name) | _np(pc.less(table[name], 0)), f"invalid_value:{name}")
    if not instances:
        flag(~_np(pc.is_in(table["label"], pa.array([0, 1], pa.int8()))), "invalid_value:label")
    else:
        for name, chars in INSTANCE_MAX_CHARS.items():
            flag(_np(pc.greater(pc.utf8_length(table[name]), chars)), f"invalid_value:{name}")
        for name, (low, high) in INSTANCE_RANGES.items():
            flag(_np(pc.or_(pc.less(table[name], low), pc.greater(table[name], high))), f"invalid_value:{name}")
    for name in ID_COLUMNS:
        flag(_np(pc.is_in(table[name], pa.array(RESERVED_IDS, pa.int64()))), f"reserved_id:{name}")
    items, cats = table["hist_item_ids"], table["hist_category_ids"]
    n_items = pc.fill_null(pc.list_value_length(items), 0).to_numpy()
    n_cats = pc.fill_null(pc.list_value_length(cats), 0).to_numpy()
    flag(n_items > spec.history_len, "invalid_value:hist_item_ids")
    flag(n_items != n_cats, "invalid_value:hist_category_ids")
    for name, col in (("hist_item_ids", items), ("hist_category_ids", cats)):
        flat = pc.list_flatten(col)
        bad_values = _np(pc.is_in(flat, pa.array(RESERVED_IDS, pa.int64()))) | _np(pc.is_null(flat))
        if bad_values.any():
            parents = pc.list_parent_indices(col).to_numpy()[bad_values]
            mask = np.zeros(n, dtype=bool)
            mask[parents] = True
            flag(mask, f"reserved_id:{name}")
    if not failed:  # the common case: no per-row reasons to assign
        return np.ones(n, dtype=bool), []
    reason = np.full(n, None, dtype=object)  # each refused row keeps the first reason that applies
    for mask, why in failed:
        fresh = mask & (reason == None)  # noqa: E711 -- elementwise on an object array
        reason[fresh] = why
    good = reason == None  # noqa: E711
    return good, [(int(i), str(reason[i])) for i in np.flatnonzero(~good)]


def _np(array) -> np.ndarray:
    """A boolean compute result as numpy, nulls as False."""
    if array.null_count:
        array = pc.fill_null(array, False)
    return np.asarray(array.to_numpy(zero_copy_only=False), dtype=bool)


def _one_line(value: bytes | None) -> bytes | None:
    """The message as one JSON line (re-encoded if it spans lines); None if not a JSON object."""
    if not value:
        return None
    if b"\n" in value or b"\r" in value:
        try:
            obj = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        return orjson.dumps(obj)
    return bytes(value)


def _read_bisecting(idx: list[int], lines: list, options: pj.ParseOptions,
                    parts: list[tuple[list[int], pa.Table]], rejected: list[tuple[int, str]]) -> None:
    """Read ``idx`` as one block; if it fails, halve it, so k bad messages among n cost
    O(k log n) block reads instead of n single reads."""
    if not idx:
        return
    try:
        table = _read_lines([lines[i] for i in idx], options)
        if table.num_rows == len(idx):
            parts.append((idx, table))
            return
        reason = "malformed_json"  # one message held several objects
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        reason = _reason_of(str(exc))
    if len(idx) == 1:
        rejected.append((idx[0], reason))
        return
    half = len(idx) // 2
    _read_bisecting(idx[:half], lines, options, parts, rejected)
    _read_bisecting(idx[half:], lines, options, parts, rejected)


def _read_lines(lines: list[bytes], options: pj.ParseOptions) -> pa.Table:
    if not lines:
        return options.explicit_schema.empty_table()
    table = pj.read_json(io.BytesIO(b"\n".join(lines) + b"\n"), parse_options=options,
                         read_options=pj.ReadOptions(block_size=max(1 << 14, 2 * sum(map(len, lines)) + 1024)))
    return table.select(options.explicit_schema.names).cast(options.explicit_schema)


def _reason_of(message: str) -> str:
    if "Failed to convert" in message or "changed from" in message or "too big" in message:
        column = re.search(r"Column\(/([A-Za-z0-9_]+)", message)  # pyarrow names the field when it can
        return f"wrong_type:{column.group(1)}" if column else "wrong_type"
    return "malformed_json"
