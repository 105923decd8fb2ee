"""Predict request bodies, from bytes straight to checked feature columns.

A body is ``{"instances": [instance, ...]}``, an instance being the sample schema without
its label (docs/samples.md). msgspec decodes and type-checks the whole body in one C pass
against a struct derived from the served version's :class:`FeatureSpec`: an int field
refuses floats, bools, strings, nulls and out-of-range numbers, counters refuse negatives.
Only a body that fails is decoded again, instance by instance and field by field, so the
error names every bad field of each bad instance (of the first :data:`MAX_SHOWN` bad
instances). Why not ``contracts.sample_wire.decode_samples`` (the Kafka path):
re-encoding each instance for pyarrow's JSON reader costs more per batch than the model
itself (bench/RESULTS.md, serving_decode).

Checks that need more than one field (reserved ids, history lengths, ``sample_version``)
run in numpy over a whole batch in :meth:`InstanceDecoder.columns`; the rules are those
of ``contracts.sample_wire.check_samples``, and ``tests/test_serving_request.py`` checks
that both give the same verdicts and the same features.
"""

from __future__ import annotations

import re
from itertools import chain
from operator import attrgetter
from typing import Annotated, Any

import msgspec
import numpy as np
import pyarrow as pa

from streamrec.model.columns import FeatureColumns, device_hashes
from streamrec.contracts.feature_spec import HISTORY_COLUMNS, ID_COLUMNS, INT_COLUMNS, SAMPLE_VERSION, FeatureSpec
from streamrec.contracts.sample_wire import INSTANCE_MAX_CHARS, INSTANCE_RANGES, MAX_DEVICE_CHARS, RESERVED_IDS, RESERVED_MAX
from streamrec.serving.by_ids import CANDIDATE_FIELDS, ByIdsQuery, query_of
from streamrec.serving.errors import ApiError

INT64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
INT32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
COUNT = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
MAX_SHOWN = 10  # bad instances a 400 lists, each with every problem it has (docs/serving.md)
MAX_UNKNOWN = 10  # unknown fields a 400 lists per instance: the spec bounds the others, not these


_TYPES = {pa.int64(): INT64, pa.int32(): INT32, pa.string(): str, pa.list_(pa.int64()): list[INT64]}
_BOUNDED = {**{name: Annotated[str, msgspec.Meta(max_length=chars)] for name, chars in INSTANCE_MAX_CHARS.items()},
            **{name: Annotated[int, msgspec.Meta(ge=low, le=high)] for name, (low, high) in INSTANCE_RANGES.items()}}


def instance_struct(spec: FeatureSpec) -> type[msgspec.Struct]:
    """The typed predict instance of ``spec``: the fields of ``spec.schema()``, counters never
    negative, strings and ranges bounded as the sample checks bound an instance's, the meta
    fields (sample_version, ids) and the label optional (a replayed sample is an instance).
    Any other field is refused: an instance built for another feature spec (another counter
    window, say) must not be scored as if it were of this one."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in spec.fields(with_label=True):
        if f.role == "counter":
            fields.append((f.name, COUNT))
        elif f.role in ("meta", "label"):
            fields.append((f.name, _BOUNDED.get(f.name, int if pa.types.is_integer(f.type) else str) | None, None))
        else:
            fields.append((f.name, _BOUNDED.get(f.name, _TYPES[f.type])))
    return msgspec.defstruct("Instance", fields, kw_only=True, forbid_unknown_fields=True)


# What msgspec raises for a body that is not JSON: bad syntax, nesting deeper than Python's
# recursion limit, or bytes that are not UTF-8 inside a string (a UnicodeDecodeError before
# msgspec 0.23, a DecodeError naming UTF-8 since).
NOT_JSON = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)


def not_json(exc: Exception) -> ApiError:
    """The 400 for a body that :data:`NOT_JSON` refused."""
    if isinstance(exc, RecursionError):
        return ApiError(400, "request body is JSON nested too deeply (over ~1,000 levels)")
    if isinstance(exc, UnicodeDecodeError):
        return ApiError(400, f"request body is not valid UTF-8: a JSON string holds byte {exc.object[exc.start]:#04x} ({exc.reason})")
    if "UTF-8" in str(exc):  # msgspec >= 0.23 says so in a DecodeError
        return ApiError(400, f"request body is not valid UTF-8: {exc}")
    return ApiError(400, f"request body is not valid JSON: {exc}")


def value_reason(name: str, error: msgspec.ValidationError) -> str:
    """Why field ``name``'s value was refused, in the vocabulary of the sample checks
    (``wrong_type:user_id``, ...): a null is a missing value, a number or string past its
    bound an invalid one."""
    message = str(error)
    if "got `null`" in message:
        return f"missing_field:{name}"
    if re.search(r"Expected `(int|str)` (of length )?[<>]=", message):
        return f"invalid_value:{name}"
    return f"wrong_type:{name}"


def field_reasons(instance: dict, fields: tuple[msgspec.structs.FieldInfo, ...]) -> list[str]:
    """Every problem of an instance the typed decode refused, field by field (msgspec stops at
    the first): a client fixes them all in one round trip. Unknown fields come last, at most
    :data:`MAX_UNKNOWN` of them, names cut at 100 characters (a body may hold any number)."""
    reasons = []
    for f in fields:
        if f.name not in instance:
            reasons.extend([f"missing_field:{f.name}"] if f.required else [])
            continue
        try:
            msgspec.convert(instance[f.name], f.type)
        except msgspec.ValidationError as exc:
            reasons.append(value_reason(f.name, exc))
    known = {f.name for f in fields}
    unknown = [f"unknown_field:{key[:100]}" for key in instance if key not in known]
    more = [f"{len(unknown) - MAX_UNKNOWN} more unknown fields"] if len(unknown) > MAX_UNKNOWN else []
    return reasons + unknown[:MAX_UNKNOWN] + more


class InstanceDecoder:
    """Decodes predict bodies and turns batches of instances into :class:`FeatureColumns`."""

    def __init__(self, spec: FeatureSpec, max_instances: int) -> None:
        self.spec, self.max_instances = spec, max_instances
        self.instance = instance_struct(spec)
        self._fields = msgspec.structs.fields(self.instance)
        self._body = msgspec.json.Decoder(msgspec.defstruct("PredictBody", [("instances", list[self.instance])]))
        self._ints = attrgetter(*INT_COLUMNS, *spec.counter_columns())
        self._n_ints, self._width = len(INT_COLUMNS), len(INT_COLUMNS) + len(spec.counter_columns())

    def decode(self, body: bytes) -> list:
        """The instances of a request body; ApiError (400/413) with a clear message otherwise."""
        try:
            instances = self._body.decode(body).instances
        except NOT_JSON:
            raise self._explain(body) from None
        if not instances:
            raise ApiError(400, "the body needs 'instances': a non-empty list of instances (the sample schema without the label)")
        if len(instances) > self.max_instances:
            raise self._too_many(len(instances))
        return instances

    def _too_many(self, n: int) -> ApiError:
        return ApiError(413, f"{n:,} instances in one request; the limit is serving.max_instances ({self.max_instances:,})")

    def _explain(self, body: bytes) -> ApiError:
        """Why a body failed the typed decode (the slow path: bad requests only)."""
        try:
            data = msgspec.json.decode(body)
        except NOT_JSON as exc:
            return not_json(exc)
        if not isinstance(data, dict):
            return ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        instances = data.get("instances")
        if not isinstance(instances, list) or not instances:
            return ApiError(400, "the body needs 'instances': a non-empty list of instances (the sample schema without the label)")
        if len(instances) > self.max_instances:
            return self._too_many(len(instances))
        not_objects = [i for i, x in enumerate(instances) if not isinstance(x, dict)]
        if not_objects:
            return ApiError(400, f"instances {not_objects[:10]} are not JSON objects")
        reasons, typed, where = {}, [], []
        for i, x in enumerate(instances):
            try:
                typed.append(msgspec.convert(x, self.instance))
                where.append(i)
            except msgspec.ValidationError as exc:
                reasons[i] = ", ".join(field_reasons(x, self._fields)) or value_reason("?", exc)
        if typed:  # the cross-field checks too, so one answer names every bad instance
            reasons.update((where[j], reason) for j, reason in self.columns(typed)[1])
        error = invalid_instances([f"instance {i}: {reasons[i]}" for i in sorted(reasons)])
        if re.search(r"\b(unknown|missing)_field:", " ".join(reasons.values())):
            s = self.spec
            error.message += (f"; this node serves feature spec windows_s {list(s.windows_s)}, history_len {s.history_len}: "
                              f"counters {', '.join(s.counter_columns())}")
        return error

    def columns(self, instances: list) -> tuple[FeatureColumns, list[tuple[int, str]]]:
        """Columns of decoded instances, and [(index, reason)] of those the batch checks refuse
        (their rows are still in the columns: decode the others again without them)."""
        n, k = len(instances), self._n_ints
        ints = np.fromiter(chain.from_iterable(map(self._ints, instances)), np.int64, n * self._width).reshape(n, self._width)
        items, categories = (list(map(attrgetter(name), instances)) for name in HISTORY_COLUMNS)
        lengths = np.fromiter(map(len, items), np.int64, n)
        cols = FeatureColumns(
            ints={name: ints[:, j] for j, name in enumerate(INT_COLUMNS)},
            counters=ints[:, k:],
            device_hash=device_hashes([x.device for x in instances]),
            hist_items=np.fromiter(chain.from_iterable(items), np.int64, int(lengths.sum())),
            hist_categories=np.fromiter(chain.from_iterable(categories), np.int64),
            hist_lengths=lengths,
        )
        return cols, self._check(instances, cols, categories)

    def _check(self, instances: list, cols: FeatureColumns, categories: list) -> list[tuple[int, str]]:
        """[(index, its reasons joined by ", ")]: every cross-field problem of each instance."""
        n = len(instances)
        found: dict[int, list[str]] = {}

        def flag(mask: np.ndarray, why: str) -> None:
            for i in np.flatnonzero(mask).tolist():  # (nearly always none)
                found.setdefault(i, []).append(why)

        versions = [x.sample_version for x in instances]
        if not set(versions) <= {None, SAMPLE_VERSION}:
            flag(np.array([v is not None and v != SAMPLE_VERSION for v in versions]), "unknown_sample_version")
        for name in ID_COLUMNS:
            flag(cols.ints[name] <= RESERVED_MAX, f"reserved_id:{name}")
        category_lengths = np.fromiter(map(len, categories), np.int64, n)
        flag(cols.hist_lengths > self.spec.history_len, "invalid_value:hist_item_ids")
        flag(cols.hist_lengths != category_lengths, "invalid_value:hist_category_ids")
        for name, flat, lengths in zip(HISTORY_COLUMNS, (cols.hist_items, cols.hist_categories), (cols.hist_lengths, category_lengths)):
            bad = flat <= RESERVED_MAX
            if bad.any():
                mask = np.zeros(n, dtype=bool)
                mask[np.repeat(np.arange(n), lengths)[bad]] = True
                flag(mask, f"reserved_id:{name}")
        return [(i, ", ".join(found[i])) for i in sorted(found)]


def invalid_instances(reasons: list[str]) -> ApiError:
    """The 400 for bad instances, ``reasons`` one ``"instance i: ..."`` each: the first
    :data:`MAX_SHOWN` of them, saying so when there are more."""
    which = f", the first {MAX_SHOWN}" if len(reasons) > MAX_SHOWN else ""
    shown = "; ".join(reasons[:MAX_SHOWN])
    return ApiError(400, f"{len(reasons)} invalid instance(s){which}: {shown} (schema: docs/samples.md, without label)")


# ---------------------------------------------------------------------- predict by ids


class Context(msgspec.Struct, forbid_unknown_fields=True):
    device: Annotated[str, msgspec.Meta(max_length=MAX_DEVICE_CHARS)]
    local_hour: Annotated[int, msgspec.Meta(ge=0, le=23)]  # as the event contract checks it


class CandidateAd(msgspec.Struct, forbid_unknown_fields=True):
    item_id: INT64
    category_id: INT64
    advertiser_id: INT64
    position: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class ByIdsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``{"user_id", "context", "candidates", "ts"?, "return_features"?}``: what an ad
    server has; the features come from the node's online features."""

    user_id: INT64
    context: Context
    candidates: list[CandidateAd]
    ts: INT64 | None = None  # the request's event time (ms); default: the server's clock
    return_features: bool = False  # answer with the feature values used, per candidate
    models: Annotated[list[Annotated[str, msgspec.Meta(max_length=200)]], msgspec.Meta(min_length=1, max_length=16)] | None = None


BY_IDS_FORM = ('{"user_id": U, "context": {"device": str, "local_hour": int}, '
               '"candidates": [{"item_id", "category_id", "advertiser_id", "position"}, ...], "ts"?: ms, "models"?: [name, ...]}')


class _InstanceUser(msgspec.Struct):
    user_id: INT64


class _InstanceUsers(msgspec.Struct):
    instances: list[_InstanceUser]


_INSTANCE_USERS = msgspec.json.Decoder(_InstanceUsers)


def instances_user(body: bytes) -> int:
    """The one user an instances body scores (an experiment's variant is the user's): 400
    when its instances name different users or none."""
    try:
        users = {i.user_id for i in _INSTANCE_USERS.decode(body).instances}
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid predict request: {exc}") from None
    except NOT_JSON as exc:
        raise not_json(exc) from None
    if len(users) != 1:
        raise ApiError(400, f"an experiment's request scores one user's candidates; its instances name {len(users)} users")
    return users.pop()


class _FormKeys(msgspec.Struct):
    """The top-level keys that tell a predict body's form (their values are skipped, not decoded)."""

    instances: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    candidates: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    user_id: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_FORM_KEYS = msgspec.json.Decoder(_FormKeys)
_INSTANCES_FIRST = re.compile(rb'\s*\{\s*"instances"\s*:')


def is_by_ids(body: bytes) -> bool:
    """Which form a predict body is, from its top-level keys (a string value such as
    ``"device": "instances"`` decides nothing): by ids names candidates or a user; the
    full-feature form (and anything else, for its errors) has "instances"."""
    if _INSTANCES_FIRST.match(body):  # the usual instances body, without scanning it
        return False
    try:
        keys = _FORM_KEYS.decode(body)
    except msgspec.ValidationError:  # not an object: the instances decoder says what is wrong
        return False
    except NOT_JSON:  # unparseable: guess from the bytes, for the error message of the likelier form
        return b'"instances"' not in body and (b'"candidates"' in body or b'"user_id"' in body)
    return keys.instances is msgspec.UNSET and (keys.candidates is not msgspec.UNSET or keys.user_id is not msgspec.UNSET)


def by_ids_problems(doc: object) -> list[str]:
    """Every problem of a by-ids body the typed decode refused, as ``path: why`` (msgspec stops
    at the first): a client fixes them all in one round trip. Stops a little past
    :data:`MAX_SHOWN`; [] when the body is not an object (msgspec's own message says so)."""
    problems: list[str] = []

    def check(obj: dict, struct: type[msgspec.Struct], prefix: str) -> None:
        fields = msgspec.structs.fields(struct)
        for f in fields:
            if len(problems) > MAX_SHOWN:
                return
            name, value = prefix + f.name, obj.get(f.name, msgspec.UNSET)
            if value is msgspec.UNSET:
                problems.extend([f"{name}: missing"] if f.required else [])
            elif f.type is Context and isinstance(value, dict):
                check(value, Context, f"{name}.")
            elif f.type == list[CandidateAd] and isinstance(value, list):
                for i, candidate in enumerate(value[: MAX_SHOWN + 1]):
                    if isinstance(candidate, dict):
                        check(candidate, CandidateAd, f"{name}[{i}].")
                    else:
                        problems.append(f"{name}[{i}]: expected an object")
            else:
                try:
                    msgspec.convert(value, f.type)
                except msgspec.ValidationError as exc:
                    problems.append(f"{name}: {exc}")
        known = {f.name for f in fields}
        problems.extend(f"{prefix}{key[:100]}: unknown field" for key in list(obj)[:MAX_UNKNOWN + len(known)] if key not in known)

    if isinstance(doc, dict):
        check(doc, ByIdsRequest, "")
    return problems


class ByIdsDecoder:
    """Decodes and checks predict-by-ids bodies (400/413 with what is wrong)."""

    def __init__(self, max_candidates: int, max_future_skew_ms: int) -> None:
        self.max_candidates, self.max_future_skew_ms = max_candidates, max_future_skew_ms
        self._decoder = msgspec.json.Decoder(ByIdsRequest)

    def decode(self, body: bytes, now_ms: int) -> tuple[ByIdsRequest, ByIdsQuery]:
        """The checked request, and its query (the candidates' ids as one array; ``ts``
        defaults to ``now_ms``)."""
        try:
            request = self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            try:
                problems = by_ids_problems(msgspec.json.decode(body)) or [str(exc)]
            except NOT_JSON:  # valid JSON for the typed decode, too deep for the generic one
                problems = [str(exc)]
            more = f" (and {len(problems) - MAX_SHOWN} more)" if len(problems) > MAX_SHOWN else ""
            raise ApiError(400, f"invalid predict-by-ids request: {'; '.join(problems[:MAX_SHOWN])}{more} (expected "
                                f'{BY_IDS_FORM}, or {{"instances": [...]}} with every feature)') from None
        except NOT_JSON as exc:
            raise not_json(exc) from None
        if not request.candidates:
            raise ApiError(400, "'candidates' must be a non-empty list of candidate ads")
        if len(request.candidates) > self.max_candidates:
            raise ApiError(413, f"{len(request.candidates):,} candidates in one request; the limit is serving.max_instances "
                                f"({self.max_candidates:,})")
        if request.ts is not None and request.ts > now_ms + self.max_future_skew_ms:
            raise ApiError(400, f"'ts' {request.ts} is {request.ts - now_ms:,} ms ahead of this server's clock "
                                f"(at most {self.max_future_skew_ms:,} ms is accepted, as for events)")
        query = query_of(request, now_ms)
        ids = query.candidates[:, :3]  # item, category, advertiser
        if request.user_id <= RESERVED_MAX or int(ids.min()) <= RESERVED_MAX:
            bad = [f"user_id {request.user_id}"] if request.user_id <= RESERVED_MAX else []
            for i, j in zip(*np.nonzero(ids <= RESERVED_MAX)):
                bad.append(f"candidates[{i}].{CANDIDATE_FIELDS[j]} {ids[i, j]}")
            raise ApiError(400, f"reserved ids ({', '.join(map(str, RESERVED_IDS))}) are not entity ids: {'; '.join(bad[:10])}")
        return request, query
