"""Malformed events for robustness tests: every kind of input the pipeline must survive.

Bad events come *in addition to* the good stream (never instead of it), so the truth of
the good stream is unchanged and a consumer can check that it lost nothing. Each one
is recorded with the reason a correct validator gives for it (see contracts/events.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import orjson

from streamrec.contracts import events as ev

BAD_KINDS = (
    "malformed_json",
    "missing_field",
    "wrong_type",
    "negative_id",
    "orphan_click",
    "future_timestamp",
)
# The reason code a validator must give for each kind (orphan clicks pass a stateless
# check and are caught by the label join when their attribution window closes).
EXPECTED_REASON = {
    "malformed_json": ev.MALFORMED_JSON,
    "missing_field": ev.MISSING_FIELD,
    "wrong_type": ev.WRONG_TYPE,
    "negative_id": ev.INVALID_VALUE,
    "orphan_click": ev.ORPHAN_CLICK,
    "future_timestamp": ev.FUTURE_TIMESTAMP,
}
_FUTURE_MS = (86_400_000, 30 * 86_400_000)  # 1 to 30 days ahead


@dataclass(frozen=True)
class BadEvent:
    kind: str
    emit_ms: int
    key: bytes
    raw: bytes


class BadEventInjector:
    """Adds ~``fraction`` x (good impressions) malformed events per tick."""

    def __init__(self, fraction: float, rng: np.random.Generator, run: str) -> None:
        self.fraction = fraction
        self.rng = rng
        self.run = run
        self.count = 0

    @property
    def enabled(self) -> bool:
        return self.fraction > 0

    def inject(self, impression: Callable[[int], dict], n_impressions: int) -> list[BadEvent]:
        """Bad events derived from random impressions of this tick (``impression(i)`` decodes one)."""
        if not self.enabled or not n_impressions:
            return []
        n = int(self.rng.binomial(n_impressions, self.fraction))
        out = []
        for _ in range(n):
            template = impression(int(self.rng.integers(n_impressions)))
            kind = BAD_KINDS[int(self.rng.integers(len(BAD_KINDS)))]
            emit_ms = int(template["ts"])  # arrives in order with the good traffic
            raw = self._corrupt(kind, dict(template, event_id=f"{self.run}-b{self.count:x}"))
            self.count += 1
            out.append(BadEvent(kind, emit_ms, str(template["user_id"]).encode(), raw))
        return out

    def _corrupt(self, kind: str, event: dict) -> bytes:
        rng = self.rng
        if kind == "malformed_json":
            text = orjson.dumps(event)
            return text[: int(rng.integers(1, len(text) - 1))]
        if kind == "missing_field":
            field = list(ev.IMPRESSION_FIELDS)[int(rng.integers(len(ev.IMPRESSION_FIELDS)))]
            del event[field]
        elif kind == "wrong_type":
            field, value = [("user_id", "u-42"), ("ts", "yesterday"), ("position", 1.5), ("item_id", [1]), ("event_id", 7)][
                int(rng.integers(5))
            ]
            event[field] = value
        elif kind == "negative_id":
            field = ("user_id", "item_id")[int(rng.integers(2))]
            event[field] = -abs(event[field])
        elif kind == "orphan_click":
            event = {
                "type": "click",
                "event_id": event["event_id"],
                "ts": event["ts"],
                "user_id": event["user_id"],
                "item_id": event["item_id"],
                "request_id": f"{self.run}-orphan{self.count:x}",  # no impression has it
            }
        elif kind == "future_timestamp":
            event["ts"] = event["ts"] + int(rng.integers(*_FUTURE_MS))
        return orjson.dumps(event)
