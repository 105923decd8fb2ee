"""Experiments: which model scores a user, as a stable hash of (salt, user id) (docs/experiments.md).

Every node computes the same assignment from the same configuration and store records, with
no state per user: that is why a load balancer needs no sticky sessions.

- A user's bucket in [0, 1) hashes the experiment's salt (``salt or layer or name``) and the
  user id. Experiments of one layer share its salt, hence one bucket per user, and take
  disjoint ``[range_start, range_end)`` slices of it: a user is in at most one of them.
  Experiments of different layers hash different salts: their assignments are independent.
- A user whose bucket is in the range gets a variant by splitting the range in proportion to
  the variant shares, in listed order. A user outside it is scored by the first variant (the
  control) and reported as the variant ``"outside"``, so that grading can leave them out.
- ``shadow_share`` of the requests (a hash of the salt and the request's key, independent of
  the user's bucket) are also scored by ``shadow_model``, off the response path.

Run-time changes (``put``, ``delete``) are written to the model store first
(``modelstore/experiments.py``); ``refresh`` reads them back, so every node applies them and
a restarted node keeps them.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from streamrec.modelstore.experiments import ExperimentStore, Unreadable, check_name
from streamrec.plumbing.config import ExperimentEntry, VariantEntry, experiment_problems

log = logging.getLogger(__name__)

OUTSIDE = "outside"  # the variant reported for a user outside the experiment's range
_MASK = (1 << 64) - 1
_M1, _M2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # MurmurHash3's 64-bit finalizer
_UNIT = 2.0 ** -53


# ---------------------------------------------------------------------------- hashing
def _salt_keys(salt: str) -> tuple[int, int]:
    """Two 64-bit keys of a salt (blake2b of its UTF-8 bytes): computed once per experiment."""
    digest = hashlib.blake2b(salt.encode(), digest_size=16, person=b"streamrec-exp").digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * _M1) & _MASK
    x ^= x >> 33
    x = (x * _M2) & _MASK
    return x ^ (x >> 33)


def _keyed_bucket(keys: tuple[int, int], user_id: int) -> float:
    h = _fmix(_fmix((user_id & _MASK) ^ keys[0]) ^ keys[1])
    return (h >> 11) * _UNIT  # 53 bits: exact as a float, and never rounds up to 1.0


def bucket(salt: str, user_id: int) -> float:
    """The user's place in [0, 1) under ``salt``. Plain 64-bit integer arithmetic on the user id
    (as an int64, two's complement) keyed by a blake2b digest of the salt: the same in every
    process, on every machine and Python version (``hash()`` is salted per process)."""
    return _keyed_bucket(_salt_keys(salt), user_id)


def _fmix_array(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(_M1)  # wraps modulo 2**64, as the scalar form's mask does
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(_M2)
    return x ^ (x >> np.uint64(33))


def buckets(salt: str, user_ids: np.ndarray) -> np.ndarray:
    """``bucket`` of every id of an integer array, as float64 (equal to the scalar form)."""
    ids = np.asarray(user_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"user ids must be integers, got {ids.dtype}")
    k1, k2 = _salt_keys(salt)
    x = ids.astype(np.int64).view(np.uint64) if ids.dtype.kind == "i" else ids.astype(np.uint64)
    h = _fmix_array(_fmix_array(x ^ np.uint64(k1)) ^ np.uint64(k2))
    return (h >> np.uint64(11)).astype(np.float64) * _UNIT


def _request_bucket(salt: str, request_key: str | int) -> float:
    digest = hashlib.blake2b(f"{salt}\0shadow\0{request_key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * _UNIT


# ---------------------------------------------------------------------------- entries
def salt_of(entry: ExperimentEntry) -> str:
    """The hashed salt: an experiment of a layer shares the layer's (unless it names another)."""
    return entry.salt or entry.layer or entry.name


def _layer_of(entry: ExperimentEntry) -> str:
    return entry.layer or entry.name  # as the config's range check groups them


def entry_problems(entry: ExperimentEntry, others: Iterable[ExperimentEntry], models: Sequence[str]) -> list[str]:
    """What keeps ``entry`` from being served next to ``others`` by a node serving ``models``."""
    try:
        check_name(entry.name)
        problems = []
    except ValueError as exc:
        problems = [str(exc)]
    problems.extend(experiment_problems(entry, list(models)))
    if any(v.name == OUTSIDE for v in entry.variants):
        problems.append(f"no variant may be named {OUTSIDE!r}: it reports users outside the range")
    layer, salt = _layer_of(entry), salt_of(entry)
    for other in others:
        if other.name == entry.name or _layer_of(other) != layer:
            continue
        if salt_of(other) != salt:
            problems.append(f"shares layer {layer!r} with {other.name!r} but hashes salt {salt!r}, not {salt_of(other)!r}: "
                            "experiments of one layer share its salt")
        if entry.range_start < other.range_end and other.range_start < entry.range_end:
            problems.append(f"user range [{entry.range_start}, {entry.range_end}) overlaps {other.name!r}'s "
                            f"[{other.range_start}, {other.range_end}) in layer {layer!r}")
    return problems


def entry_to_json(entry: ExperimentEntry) -> dict:
    """The JSON form of an experiment: what ``GET /v1/experiments`` shows and ``PUT`` takes."""
    return {"name": entry.name, "variants": [{"name": v.name, "model": v.model, "share": v.share} for v in entry.variants],
            "salt": entry.salt, "layer": entry.layer, "range_start": entry.range_start, "range_end": entry.range_end,
            "shadow_model": entry.shadow_model, "shadow_share": entry.shadow_share}


_FIELDS = {"name": str, "variants": list, "salt": str, "layer": str, "range_start": float, "range_end": float,
           "shadow_model": str, "shadow_share": float}
_VARIANT_FIELDS = {"name": str, "model": str, "share": float}


def entry_from_json(body: object, name: str | None = None) -> ExperimentEntry:
    """An experiment from a request body (``name``: the one in the URL path, which a ``name`` in
    the body must match). Raises ValueError listing every malformed key; the values' meaning
    (shares, ranges, models) is checked by ``Experiments.put``."""
    problems = _shape_problems(body, _FIELDS, "")
    if problems:
        raise ValueError("; ".join(problems))
    assert isinstance(body, dict)
    if name is not None and body.get("name", name) != name:
        problems.append(f"'name' is {body['name']!r} but the path names {name!r}")
    if "name" not in body and name is None:
        problems.append("missing key 'name'")
    if "variants" not in body:
        problems.append("missing key 'variants' (a list of {\"name\", \"model\", \"share\"})")
    for i, v in enumerate(body.get("variants", [])):
        problems.extend(_shape_problems(v, _VARIANT_FIELDS, f"variants[{i}]."))
        problems.extend(f"missing key 'variants[{i}].{k}'" for k in _VARIANT_FIELDS if isinstance(v, dict) and k not in v)
    if problems:
        raise ValueError("; ".join(problems))
    variants = tuple(VariantEntry(v["name"], v["model"], float(v["share"])) for v in body["variants"])
    fields = {k: float(body[k]) if _FIELDS[k] is float else body[k] for k in body if k not in ("name", "variants")}
    return ExperimentEntry(name=body.get("name", name), variants=variants, **fields)


def _shape_problems(value: object, fields: dict[str, type], where: str) -> list[str]:
    """Unknown keys and wrong types of one JSON object (``where``: its path, for messages)."""
    if not isinstance(value, dict):
        return [f"{where.rstrip('.') or 'the body'} must be a JSON object, got {_short(value)}"]
    problems = []
    unknown = sorted(set(value) - set(fields))
    if unknown:
        problems.append(f"unknown key(s) {', '.join(repr(where + k) for k in unknown)} (known: {', '.join(fields)})")
    for key, kind in fields.items():
        if key not in value:
            continue
        v = value[key]
        if kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                problems.append(f"'{where}{key}' must be a finite number, got {_short(v)}")
        elif not isinstance(v, kind):
            problems.append(f"'{where}{key}' must be a {'string' if kind is str else 'list'}, got {_short(v)}")
    return problems


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------- serving
@dataclass(frozen=True)
class Assignment:
    """Who scores one request of an experiment: ``model`` answers; ``shadow_model``, when not
    None, also scores it off the response path."""

    experiment: str
    variant: str
    model: str
    shadow_model: str | None


class _Live:
    """One served experiment, with what ``assign`` needs precomputed."""

    def __init__(self, entry: ExperimentEntry, source: str) -> None:
        self.entry, self.source = entry, source
        self.salt = salt_of(entry)
        self.keys = _salt_keys(self.salt)
        width, total, bounds = entry.range_end - entry.range_start, 0.0, []
        for v in entry.variants:
            total += v.share
            bounds.append(entry.range_start + width * total)
        bounds[-1] = entry.range_end  # shares add up to 1 within rounding: the last variant ends the range
        self.bounds = bounds


class Experiments:
    """The experiments a node serves: the configuration's, overridden by name by the store's
    records. ``assign`` is lock-free (one read of the current map); ``put``, ``delete`` and
    ``refresh`` do blocking store I/O (run them off the event loop) and are serialised."""

    def __init__(self, entries: Iterable[ExperimentEntry], models: Sequence[str], store: ExperimentStore | None = None) -> None:
        """``store`` None: run-time changes stay in this process (tests, a node without a store)."""
        self.models, self.store = list(models), store
        self._config = {e.name: e for e in entries}
        problems = [f"experiment {e.name!r}: {p}" for i, e in enumerate(self._config.values())
                    for p in entry_problems(e, list(self._config.values())[:i], self.models)]
        if problems:
            raise ValueError("; ".join(problems))
        self._records: dict[str, dict | Unreadable | None] = {}
        self._lock = threading.Lock()
        self.ignored: dict[str, str] = {}  # store records this node does not apply, and why
        self._live = {name: _Live(e, "config") for name, e in self._config.items()}

    # -------------------------------------------------------------- reading
    def names(self) -> list[str]:
        return sorted(self._live)

    def entries(self) -> list[ExperimentEntry]:
        """Every experiment served now, by name (one read of the current map: a change on
        another thread never shows half of it)."""
        live = self._live
        return [live[name].entry for name in sorted(live)]

    def get(self, name: str) -> ExperimentEntry:
        """The experiment ``name``; KeyError if this node serves none of that name."""
        return self._live[name].entry

    def assign(self, name: str, user_id: int, request_key: str | int) -> Assignment:
        """The variant of ``user_id`` in experiment ``name`` (KeyError if none), and whether this
        request (``request_key``: the same key, the same decision) is also shadowed."""
        live = self._live[name]
        entry, b = live.entry, _keyed_bucket(live.keys, user_id)
        if entry.range_start <= b < entry.range_end:
            variant = entry.variants[min(bisect.bisect_right(live.bounds, b), len(entry.variants) - 1)]
            variant_name, model = variant.name, variant.model
        else:
            variant_name, model = OUTSIDE, entry.variants[0].model
        shadow = None
        if entry.shadow_share > 0 and _request_bucket(live.salt, request_key) < entry.shadow_share:
            shadow = entry.shadow_model
        return Assignment(entry.name, variant_name, model, shadow)

    def as_json(self) -> dict:
        """``GET /v1/experiments``: each experiment with its source ("config" or "store"), the
        configured ones deleted at run time, and store records this node does not apply."""
        live = self._live
        return {"experiments": [{**entry_to_json(live[n].entry), "source": live[n].source} for n in sorted(live)],
                "deleted": sorted(n for n in self._config if self._records.get(n, {}) is None),
                "ignored": dict(self.ignored)}

    # -------------------------------------------------------------- changing
    def put(self, entry: ExperimentEntry) -> None:
        """Add or replace an experiment on every node: ValueError with its problems (nothing is
        written), OSError if the store cannot be read or does not take it (nothing is written).
        It is checked against the store's records as every node reads them now, not against
        this node's last poll: once it succeeds, every node serving its models serves it."""
        with self._lock:
            self._apply(self._stored())
            problems = entry_problems(entry, [x.entry for x in self._live.values()], self.models)
            if problems:
                raise ValueError(f"experiment {entry.name!r}: " + "; ".join(problems))
            record = entry_to_json(entry)
            records = {**self._records, entry.name: record}
            live, ignored = self._resolve(records)
            lost = sorted(set(self._live) - set(live))
            if entry.name not in live or lost:  # the whole set, as every node will rebuild it, must serve it and drop nothing
                why = ignored.get(entry.name) or f"it would stop experiment(s) {lost} in force (their layer and range overlap)"
                raise ValueError(f"experiment {entry.name!r}: {why}")
            if self.store is not None:
                self.store.put(entry.name, record)
            self._apply(records)

    def delete(self, name: str) -> None:
        """Stop serving ``name`` on every node (KeyError if neither served nor ignored here;
        OSError as ``put``). Deleting an ignored record replaces it with a tombstone."""
        with self._lock:
            self._apply(self._stored())
            if name not in self._live and name not in self.ignored:
                raise KeyError(name)
            if self.store is not None:
                self.store.delete(name)
            self._apply({**self._records, name: None})

    def refresh(self) -> None:
        """Apply the store's records (call at start, before serving, and every poll interval).
        OSError: the store could not be read; nothing changes."""
        if self.store is None:
            return
        with self._lock:
            self._apply(self.store.load())

    def _stored(self) -> dict[str, dict | Unreadable | None]:
        """The store's records now (this node's own without a store); OSError if unreadable."""
        return self.store.load() if self.store is not None else self._records

    def _apply(self, records: dict[str, dict | Unreadable | None]) -> None:
        """Serve the configuration overridden by ``records``. A record that is unreadable or
        malformed, names a model this node does not serve, or conflicts with an experiment
        already taken (the configuration's first, then the store's by name: every node decides
        alike) is not served here, and is listed in ``ignored``."""
        live, ignored = self._resolve(records)
        for name in sorted(set(ignored) - set(self.ignored)):
            log.warning("experiment %r from the model store is not served on this node: %s", name, ignored[name])
        self._records, self.ignored, self._live = records, ignored, live

    def _resolve(self, records: dict[str, dict | Unreadable | None]) -> tuple[dict[str, _Live], dict[str, str]]:
        """The experiments served and the records ignored (with why) under ``records``. An
        unreadable record hides the configured experiment of its name, as a malformed one does:
        what it meant (a change, a deletion) is unknown, and every node must decide alike."""
        live = {n: _Live(e, "config") for n, e in self._config.items() if n not in records}
        ignored = {}
        for name in sorted(records):
            if records[name] is None:
                continue
            if isinstance(records[name], Unreadable):
                ignored[name] = records[name].why
                continue
            try:
                entry = entry_from_json(records[name], name=name)
            except ValueError as exc:
                ignored[name] = str(exc)
                continue
            problems = entry_problems(entry, [x.entry for x in live.values()], self.models)
            if problems:
                ignored[name] = "; ".join(problems)
            else:
                live[name] = _Live(entry, "store")
        return live, ignored
