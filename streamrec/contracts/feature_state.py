"""The Flink job's per-entity feature state as it travels on ``streamrec.features``, and
the features of a sample computed from it with exactly the samples' semantics.

The job (``SampleJob.java``, docs/features.md) publishes, per watermark and changed entity,
the state its stages hold; the topic is compacted, so its latest value per key is the state.
Keys and values (UTF-8; JSON values):

- ``c/{entity}/{id}/{bucket_start_ms}`` -> ``{"i": [offsets], "c": [offsets]}``: the entity's
  counted impression and click times within one time bucket, as ms offsets from its start,
  ascending, repeated for events at the same ms. A tombstone (null value): the bucket
  has no time left that any window can still reach.
- ``h/user/{id}`` -> ``{"h": [[item_id, category_id, ts], ...]}``: the user's joined clicks,
  most recent first (the job's behaviour sequence).
- ``w/{stage}/{subtask}/{partition}`` -> ``{"wm": ms, "n": parallelism}``: the stage subtask
  has applied, and published to this partition, every event at or before ``wm``.

An entity's keys share a partition: ``murmur2("{entity}/{id}")`` (:func:`entity_partition`,
the Kafka default partitioner's hash), so a reader can take a partition-affine share.

Why buckets of exact times and not counts: a sample's counter covers the open interval
``(ts - W, ts)`` to the millisecond; only the times give the same count for any ``ts``.
A hot entity re-sends only its current bucket.
"""

from __future__ import annotations

import bisect
from array import array
from itertools import chain
from dataclasses import dataclass, field

import orjson
from kafka.partitioner.default import murmur2

from streamrec.contracts.feature_spec import COUNTER_ENTITIES, FeatureSpec

END_OF_INPUT = 2**63 - 1  # Flink's final watermark (Long.MAX_VALUE)
ENTITIES = COUNTER_ENTITIES  # user | item | category: the job's keyed stages, in order


class CorruptFeatureMessage(ValueError):
    """A message of the features topic that does not follow the format (counted, skipped)."""


def entity_partition(entity: str, entity_id: int, partitions: int) -> int:
    """The partition of every key of one entity (the job writes them there)."""
    return (murmur2(f"{entity}/{entity_id}".encode()) & 0x7FFFFFFF) % partitions


@dataclass(frozen=True)
class CounterBucket:
    entity: str
    entity_id: int
    start_ms: int
    imps: array | None  # absolute event times; None: the bucket is gone (tombstone)
    clicks: array | None


@dataclass(frozen=True)
class History:
    user_id: int
    clicks: tuple[tuple[int, int, int], ...]  # (item_id, category_id, ts), most recent first


@dataclass(frozen=True)
class StageWatermark:
    stage: str
    subtask: int
    partition: int
    watermark_ms: int
    parallelism: int


_INT64 = (-(2**63), 2**63 - 1)


def _int(text: str, what: str, key: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CorruptFeatureMessage(f"key {key!r}: {what} {text!r} is not an integer") from None
    if not _INT64[0] <= value <= _INT64[1]:
        raise CorruptFeatureMessage(f"key {key!r}: {what} {text!r} does not fit in 64 bits")
    return value


def _times(values, start: int, key: str) -> array:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise CorruptFeatureMessage(f"key {key!r}: bucket times must be a list of non-negative integer offsets")
    if any(b < a for a, b in zip(values, values[1:])):
        raise CorruptFeatureMessage(f"key {key!r}: bucket times are not ascending")
    if values and start + values[-1] > _INT64[1]:
        raise CorruptFeatureMessage(f"key {key!r}: bucket times do not fit in 64 bits")
    return array("q", [start + v for v in values])


def decode_message(key: bytes | None, value: bytes | None) -> CounterBucket | History | StageWatermark:
    """One record of the features topic; CorruptFeatureMessage says what is wrong with it."""
    if key is None:
        raise CorruptFeatureMessage("a record without a key")
    try:
        text = key.decode()
    except UnicodeDecodeError:
        raise CorruptFeatureMessage(f"key {key[:60]!r} is not UTF-8") from None
    parts = text.split("/")
    try:
        data = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError as exc:
        raise CorruptFeatureMessage(f"key {text!r}: value is not JSON ({exc})") from None
    if value is not None and not isinstance(data, dict):
        raise CorruptFeatureMessage(f"key {text!r}: value must be a JSON object")
    if parts[0] == "c" and len(parts) == 4 and parts[1] in ENTITIES:
        start = _int(parts[3], "bucket start", text)
        if data is None:
            return CounterBucket(parts[1], _int(parts[2], "id", text), start, None, None)
        return CounterBucket(parts[1], _int(parts[2], "id", text), start, _times(data.get("i", []), start, text),
                             _times(data.get("c", []), start, text))
    if parts[0] == "h" and len(parts) == 3 and parts[1] == "user":
        entries = [] if data is None else data.get("h")
        if not isinstance(entries, list) or not all(type(e) is list and len(e) == 3 for e in entries):
            raise CorruptFeatureMessage(f"key {text!r}: 'h' must be a list of [item_id, category_id, ts]")
        flat = list(chain.from_iterable(entries))
        if not all(type(v) is int for v in flat) or (flat and not (_INT64[0] <= min(flat) and max(flat) <= _INT64[1])):
            raise CorruptFeatureMessage(f"key {text!r}: 'h' must be a list of [item_id, category_id, ts], 64-bit integers")
        return History(_int(parts[2], "id", text), tuple(map(tuple, entries)))
    if parts[0] == "w" and len(parts) == 4 and parts[1] in ENTITIES:
        if data is None or type(data.get("wm")) is not int or type(data.get("n")) is not int or data["n"] < 1:
            raise CorruptFeatureMessage(f"key {text!r}: a watermark needs integer 'wm' and 'n' >= 1")
        return StageWatermark(parts[1], _int(parts[2], "subtask", text), _int(parts[3], "partition", text), data["wm"], data["n"])
    raise CorruptFeatureMessage(f"unknown key {text!r} (expected c/<entity>/<id>/<bucket>, h/user/<id> or w/<stage>/<subtask>/<partition>)")


class EntityCounts:
    """One entity's impression and click times, sorted.

    Held as an ``array('q')`` (8 bytes a time: most entities, users above all, have few)
    or, past :data:`LIST_ABOVE` times, a list: ``bisect`` on a list compares ints without
    boxing them (faster), and a hot item or category is looked up on most requests.

    A bucket's new content replaces the held times in its range. Times only leave a bucket
    by expiry (its oldest first), so the held times older than the new content's first are
    kept, as are the times of a bucket that became empty or a tombstone: :meth:`expire`
    forgets them later, on the reader's own horizon, so a request somewhat in the past still
    counts them."""

    __slots__ = ("imps", "clicks")

    def __init__(self, imps: array | None = None, clicks: array | None = None) -> None:
        self.imps = _compact(imps if imps is not None else array("q"))
        self.clicks = _compact(clicks if clicks is not None else array("q"))

    def put(self, bucket: CounterBucket) -> None:
        if bucket.imps is None:
            return
        self.imps = _replace_range(self.imps, bucket.imps)
        self.clicks = _replace_range(self.clicks, bucket.clicks)

    def expire(self, cutoff_ms: int) -> None:
        """Forget times at or before ``cutoff_ms`` (no window reaches them)."""
        for name in ("imps", "clicks"):
            times = getattr(self, name)
            if times and times[0] <= cutoff_ms:
                del times[:bisect.bisect_right(times, cutoff_ms)]
                setattr(self, name, _compact(times))

    def counts(self, ts: int, windows_ms: tuple[int, ...]) -> list[int]:
        """[imps W0, clicks W0, imps W1, ...] over the open interval (ts - W, ts)."""
        imps, clicks = self.imps, self.clicks
        hi_i = len(imps) if not imps or imps[-1] < ts else bisect.bisect_left(imps, ts)
        hi_c = len(clicks) if not clicks or clicks[-1] < ts else bisect.bisect_left(clicks, ts)
        out = []
        for w in windows_ms:
            out.append(hi_i - bisect.bisect_right(imps, ts - w, 0, hi_i))
            out.append(hi_c - bisect.bisect_right(clicks, ts - w, 0, hi_c))
        return out

    def counts_until(self, ts: int, windows_ms: tuple[int, ...]) -> tuple[list[int], int]:
        """:meth:`counts` at ``ts``, and the first ms after ``ts`` at which they change (an
        event enters a window or leaves one): they hold for every request in [ts, that ms)
        while the entity gets no update. Lets a reader reuse one entity's counts across requests."""
        out, until = [], END_OF_INPUT
        for times in (self.imps, self.clicks):
            n = len(times)
            hi = n if not times or times[-1] < ts else bisect.bisect_left(times, ts)
            if hi < n:
                until = min(until, times[hi] + 1)  # the next event enters every window
            for w in windows_ms:
                lo = bisect.bisect_right(times, ts - w, 0, hi)
                out.append(hi - lo)
                if lo < hi:
                    until = min(until, times[lo] + w)  # the oldest counted event leaves this window
        w = len(windows_ms)
        return [out[(k % 2) * w + k // 2] for k in range(2 * w)], until  # [imps W0, clicks W0, imps W1, ...]

    def nbytes(self) -> int:
        return sum(40 * len(t) if isinstance(t, list) else 8 * len(t) for t in (self.imps, self.clicks)) + 200


LIST_ABOVE = 256  # times of one kind past which EntityCounts holds a list (see there)


def _compact(times: array | list) -> array | list:
    """The container for this many times."""
    if isinstance(times, list):
        return times if len(times) > LIST_ABOVE // 2 else array("q", times)  # hysteresis: no flapping at the edge
    return times.tolist() if len(times) > LIST_ABOVE else times


def _replace_range(held: array | list, new: array) -> array | list:
    """``held`` with its times within [new[0], new[-1]] replaced by ``new`` (unchanged if
    ``new`` is empty). Within one partition a bucket's messages arrive in order, so ``new``
    holds every held time of that range that has not expired."""
    if not new:
        return held
    lo = bisect.bisect_left(held, new[0]) if held and held[-1] >= new[0] else len(held)
    hi = bisect.bisect_right(held, new[-1], lo) if lo < len(held) else lo
    held[lo:hi] = new if isinstance(held, array) else new.tolist()
    return _compact(held)


class UserHistory:
    """A user's joined clicks, most recent first, flat: (item_id, category_id, ts) triples.
    Keeps up to ``keep`` entries: the job's list plus older ones it has since dropped, so a
    request a little in the past still sees a full history."""

    __slots__ = ("flat",)

    def __init__(self, flat: array | None = None) -> None:
        self.flat = flat if flat is not None else array("q")

    def put(self, history: History, keep: int) -> None:
        new = array("q", [v for entry in history.clicks for v in entry])
        held = self.flat
        if new and held:
            oldest = new[-1]
            older = [k for k in range(2, len(held), 3) if held[k] < oldest]
            if older:
                new += held[older[0] - 2:]
        self.flat = new[: 3 * keep]

    def before(self, ts: int, n: int) -> tuple[list[int], list[int]]:
        """(items, categories) of the last ``n`` clicks strictly before ``ts``."""
        flat, skip = self.flat, 0
        while 3 * skip < len(flat) and flat[3 * skip + 2] >= ts:
            skip += 1  # clicks at this very millisecond are not visible yet
        chosen = flat[3 * skip: 3 * (skip + n)]
        return chosen[0::3].tolist(), chosen[1::3].tolist()

    def nbytes(self) -> int:
        return 8 * len(self.flat) + 80


@dataclass
class Watermarks:
    """Per partition, per stage subtask: how far the state is complete. ``as_of`` is the
    time before which every event is in the state (the samples' ``ts`` it can reproduce)."""

    marks: dict[tuple[int, str, int], int] = field(default_factory=dict)  # (partition, stage, subtask) -> wm
    parallelism: dict[str, int] = field(default_factory=dict)
    # as_of per partition count, with the number of puts it was computed after (serving asks it for every request)
    _as_of: dict[int, tuple[int, int | None]] = field(default_factory=dict, repr=False, compare=False)
    _puts: int = field(default=0, repr=False, compare=False)

    def put(self, mark: StageWatermark) -> None:
        if mark.watermark_ms >= END_OF_INPUT:
            return  # a bounded job's last watermark: says nothing about event time, keeps the last real one
        self.marks[(mark.partition, mark.stage, mark.subtask)] = mark.watermark_ms
        self.parallelism[mark.stage] = mark.parallelism
        self._puts += 1

    def as_of(self, partitions: int) -> int | None:
        """Every event strictly before this ms is in the state (None: not every stage
        subtask has reported to every partition yet). Change ``marks`` only through
        :meth:`put` once this has been asked."""
        puts = self._puts
        cached = self._as_of.get(partitions)
        if cached is not None and cached[0] == puts:
            return cached[1]
        lowest = self._lowest(partitions)
        self._as_of[partitions] = (puts, lowest)  # a put meanwhile (another thread) makes it stale: recomputed next time
        return lowest

    def _lowest(self, partitions: int) -> int | None:
        lowest = None
        for p in range(partitions):
            for stage in ENTITIES:
                n = self.parallelism.get(stage)
                if n is None:
                    return None
                for subtask in range(n):
                    wm = self.marks.get((p, stage, subtask))
                    if wm is None:
                        return None
                    lowest = wm if lowest is None else min(lowest, wm)
        return None if lowest is None else lowest + 1


@dataclass(frozen=True)
class Candidate:
    item_id: int
    category_id: int
    advertiser_id: int
    position: int


def differing_features(spec: FeatureSpec, served: dict, sample: dict) -> list[str]:
    """The names of the model inputs whose values differ between two forms of one impression
    (e.g. what serving assembled by ids and the job's sample)."""
    return [name for name in spec.feature_names() if served.get(name) != sample.get(name)]
