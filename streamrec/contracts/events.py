"""The raw event contract of ``streamrec.events`` (JSON, key = user id).

This module is the reference definition: the generator writes it, the Flink job parses
it (``EventParser.java``, to the same rules, from the spec ``validation_spec.py`` derives
from this module) and :func:`validate_event` is the executable spec both are tested
against. Rejected events go to ``streamrec.events.dlq`` with one of the reason codes
below. See docs/events.md.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import orjson

EVENT_VERSION = 1
# Events more than this far ahead of the checker's clock are rejected as far-future.
MAX_FUTURE_SKEW_MS = 10 * 60 * 1000

# Reason codes for rejected events (the DLQ's "reason" field starts with one of these).
MALFORMED_JSON = "malformed_json"
NOT_AN_OBJECT = "not_an_object"
UNKNOWN_TYPE = "unknown_type"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
INVALID_VALUE = "invalid_value"
FUTURE_TIMESTAMP = "future_timestamp"
# Detectable only with state (the label join): a click whose impression never arrives.
ORPHAN_CLICK = "orphan_click"

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# field -> (python type, must be positive)
_COMMON = {
    "event_id": (str, False),
    "ts": (int, True),
    "user_id": (int, True),
    "item_id": (int, True),
    "request_id": (str, False),
}
IMPRESSION_FIELDS = {
    **_COMMON,
    "position": (int, True),
    "context": (dict, False),
    "item": (dict, False),
}
CLICK_FIELDS = dict(_COMMON)
CONTEXT_FIELDS = {"device": (str, False), "local_hour": (int, False)}
ITEM_FIELDS = {"category_id": (int, False), "advertiser_id": (int, False)}
EVENT_TYPES = {"impression": IMPRESSION_FIELDS, "click": CLICK_FIELDS}


class InvalidEvent(ValueError):
    """An event that breaks the contract; ``reason`` is a code from this module plus detail."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _check_fields(obj: dict, spec: dict[str, tuple[type, bool]], prefix: str) -> None:
    for name, (kind, positive) in spec.items():
        if name not in obj or obj[name] is None:
            raise InvalidEvent(f"{MISSING_FIELD}:{prefix}{name}")
        value = obj[name]
        # bool is an int subclass in Python; JSON true is never a valid id or timestamp.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidEvent(f"{WRONG_TYPE}:{prefix}{name}")
        # Ids and timestamps are int64 in the sample schema (and in the job's parser); orjson
        # hands back integers up to 2**64 - 1, which no int64 column can hold.
        if kind is int and not _INT64_MIN <= value <= _INT64_MAX:
            raise InvalidEvent(f"{WRONG_TYPE}:{prefix}{name} does not fit in 64 bits")
        if kind is str and not value:
            raise InvalidEvent(f"{INVALID_VALUE}:{prefix}{name} is empty")
        if positive and value <= 0:
            raise InvalidEvent(f"{INVALID_VALUE}:{prefix}{name}={value} must be > 0")


def validate_event(raw: bytes | str, now_ms: int | None = None) -> dict[str, Any]:
    """Parse and check one raw event; return it as a dict or raise :class:`InvalidEvent`."""
    try:
        event = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidEvent(f"{MALFORMED_JSON}: {exc}") from None
    if not isinstance(event, dict):
        raise InvalidEvent(f"{NOT_AN_OBJECT}: got {type(event).__name__}")
    kind = event.get("type")
    if not isinstance(kind, str) or kind not in EVENT_TYPES:  # a list or object is unhashable
        raise InvalidEvent(f"{UNKNOWN_TYPE}: {kind!r}")
    _check_fields(event, EVENT_TYPES[kind], "")
    if kind == "impression":
        _check_fields(event["context"], CONTEXT_FIELDS, "context.")
        _check_fields(event["item"], ITEM_FIELDS, "item.")
        if not 0 <= event["context"]["local_hour"] <= 23:
            raise InvalidEvent(f"{INVALID_VALUE}:context.local_hour={event['context']['local_hour']}")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if event["ts"] > now_ms + MAX_FUTURE_SKEW_MS:
        raise InvalidEvent(f"{FUTURE_TIMESTAMP}: ts={event['ts']} is {event['ts'] - now_ms} ms ahead")
    return event


# Fast encoders for the generator's hot path: %-formatting straight to the JSON bytes that
# orjson.dumps would give for the same dict (compact, same key order) at a fraction of its cost.
# Only valid for strings that need no JSON escaping, which holds for the generator's
# hex ids and device names; tests/test_generator.py checks byte-equality with orjson.
_IMPRESSION_TEMPLATE = (
    '{"type":"impression","event_id":"%s","ts":%d,"user_id":%d,"item_id":%d,"request_id":"%s",'
    '"position":%d,"context":{"device":"%s","local_hour":%d},"item":{"category_id":%d,"advertiser_id":%d}}'
)
_CLICK_TEMPLATE = '{"type":"click","event_id":"%s","ts":%d,"user_id":%d,"item_id":%d,"request_id":"%s"}'


def encode_impressions(columns: Iterable[Sequence[Any]]) -> list[bytes]:
    """Rows of (event_id, ts, user_id, item_id, request_id, position, device, local_hour,
    category_id, advertiser_id) -> impression JSON bytes."""
    template = _IMPRESSION_TEMPLATE
    return [(template % row).encode() for row in zip(*columns)]


def encode_click(event_id: str, ts: int, user_id: int, item_id: int, request_id: str) -> bytes:
    return (_CLICK_TEMPLATE % (event_id, ts, user_id, item_id, request_id)).encode()
