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
from dataclasses import dataclass, field

import orjson
from kafka.partitioner.default import murmur2

from pipelines.feature_spec import COUNTED_EVENTS, COUNTER_ENTITIES, FeatureSpec

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


def _int(text: str, what: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CorruptFeatureMessage(f"key {key!r}: {what} {text!r} is not an integer") from None


def _times(values, start: int, key: str) -> array:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise CorruptFeatureMessage(f"key {key!r}: bucket times must be a list of non-negative integer offsets")
    if any(b < a for a, b in zip(values, values[1:])):
        raise CorruptFeatureMessage(f"key {key!r}: bucket times are not ascending")
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
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 3 and all(type(v) is int for v in e) for e in entries):
            raise CorruptFeatureMessage(f"key {text!r}: 'h' must be a list of [item_id, category_id, ts]")
        return History(_int(parts[2], "id", text), tuple(tuple(e) for e in entries))
    if parts[0] == "w" and len(parts) == 4 and parts[1] in ENTITIES:
        if data is None or type(data.get("wm")) is not int or type(data.get("n")) is not int or data["n"] < 1:
            raise CorruptFeatureMessage(f"key {text!r}: a watermark needs integer 'wm' and 'n' >= 1")
        return StageWatermark(parts[1], _int(parts[2], "subtask", text), _int(parts[3], "partition", text), data["wm"], data["n"])
    raise CorruptFeatureMessage(f"unknown key {text!r} (expected c/<entity>/<id>/<bucket>, h/user/<id> or w/<stage>/<subtask>/<partition>)")


class EntityCounts:
    """One entity's impression and click times, by bucket, with sorted copies for counting."""

    __slots__ = ("buckets", "imps", "clicks")

    def __init__(self) -> None:
        self.buckets: dict[int, tuple[array, array]] = {}
        self.imps, self.clicks = array("q"), array("q")

    def put(self, bucket: CounterBucket) -> None:
        """A bucket's new content. Times only leave a bucket by expiry (its oldest first), so
        the held times older than the new content's first are kept, as is a bucket that
        became empty or a tombstone: :meth:`expire` forgets them later, on the reader's
        own horizon, so a request somewhat in the past still counts them."""
        if bucket.imps is None:
            return
        held = self.buckets.get(bucket.start_ms)
        if held is None:
            self.buckets[bucket.start_ms] = (bucket.imps, bucket.clicks)
        else:
            self.buckets[bucket.start_ms] = (_keep_older(held[0], bucket.imps), _keep_older(held[1], bucket.clicks))
        self._merge()

    def expire(self, cutoff_ms: int) -> None:
        """Forget buckets whose every time is at or before ``cutoff_ms`` (no window reaches them)."""
        old = [s for s, (i, c) in self.buckets.items() if max(i[-1] if i else s, c[-1] if c else s) <= cutoff_ms]
        for start in old:
            del self.buckets[start]
        if old:
            self._merge()

    def _merge(self) -> None:
        imps, clicks = array("q"), array("q")
        for start in sorted(self.buckets):
            i, c = self.buckets[start]
            imps.extend(i)
            clicks.extend(c)
        self.imps, self.clicks = imps, clicks  # one assignment each: readers see old or new

    def counts(self, ts: int, windows_ms: tuple[int, ...]) -> list[int]:
        """[imps W0, clicks W0, imps W1, ...] over the open interval (ts - W, ts)."""
        imps, clicks = self.imps, self.clicks
        hi_i, hi_c = bisect.bisect_left(imps, ts), bisect.bisect_left(clicks, ts)
        out = []
        for w in windows_ms:
            out.append(hi_i - bisect.bisect_right(imps, ts - w, 0, hi_i))
            out.append(hi_c - bisect.bisect_right(clicks, ts - w, 0, hi_c))
        return out

    def nbytes(self) -> int:
        return 16 * (len(self.imps) + len(self.clicks)) + 120 * len(self.buckets) + 200

    def to_json(self) -> list:
        return [[s, list(i), list(c)] for s, (i, c) in self.buckets.items()]

    @classmethod
    def from_json(cls, data: list) -> "EntityCounts":
        counts = cls()
        counts.buckets = {s: (array("q", i), array("q", c)) for s, i, c in data}
        counts._merge()
        return counts


def _keep_older(held: array, new: array) -> array:
    """``new`` preceded by the held times older than its first (all of them if it is empty)."""
    if not new:
        return held
    cut = bisect.bisect_left(held, new[0])
    return held[:cut] + new if cut else new


class UserHistory:
    """A user's joined clicks, most recent first. Keeps up to ``keep`` entries: the job's
    list plus older ones it has since dropped, so a request a little in the past still sees
    a full history."""

    __slots__ = ("clicks",)

    def __init__(self, clicks: tuple[tuple[int, int, int], ...] = ()) -> None:
        self.clicks = clicks

    def put(self, history: History, keep: int) -> None:
        new = history.clicks
        if new and self.clicks:
            oldest = new[-1][2]
            new = new + tuple(e for e in self.clicks if e[2] < oldest)
        self.clicks = new[:keep]

    def before(self, ts: int, n: int) -> tuple[list[int], list[int]]:
        """(items, categories) of the last ``n`` clicks strictly before ``ts``."""
        clicks, skip = self.clicks, 0
        while skip < len(clicks) and clicks[skip][2] >= ts:
            skip += 1  # clicks at this very millisecond are not visible yet
        chosen = clicks[skip: skip + n]
        return [c[0] for c in chosen], [c[1] for c in chosen]

    def nbytes(self) -> int:
        return 100 + 88 * len(self.clicks)


@dataclass
class Watermarks:
    """Per partition, per stage subtask: how far the state is complete. ``as_of`` is the
    time before which every event is in the state (the samples' ``ts`` it can reproduce)."""

    marks: dict[tuple[int, str, int], int] = field(default_factory=dict)  # (partition, stage, subtask) -> wm
    parallelism: dict[str, int] = field(default_factory=dict)

    def put(self, mark: StageWatermark) -> None:
        if mark.watermark_ms >= END_OF_INPUT:
            return  # a bounded job's last watermark: says nothing about event time, keeps the last real one
        self.marks[(mark.partition, mark.stage, mark.subtask)] = mark.watermark_ms
        self.parallelism[mark.stage] = mark.parallelism

    def as_of(self, partitions: int) -> int | None:
        """Every event strictly before this ms is in the state (None: not every stage
        subtask has reported to every partition yet)."""
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


def counter_row(spec: FeatureSpec, user: list[int], item: list[int], category: list[int]) -> list[int]:
    """The counters of one sample in ``spec.counter_columns()`` order from each entity's
    :meth:`EntityCounts.counts` (layout [imps W0, clicks W0, imps W1, ...])."""
    row = []
    per_entity = dict(zip(ENTITIES, (user, item, category)))
    for w in range(len(spec.windows_s)):
        for entity in ENTITIES:
            counts = per_entity[entity]
            row.extend(counts[2 * w: 2 * w + len(COUNTED_EVENTS)])
    return row
