"""Callers: a quota (token bucket) and a priority per API key, and shedding by priority under
overload (docs/experiments.md, "Callers, quotas and priorities").

``Callers.admit`` runs on the event loop's thread for every predict request before its body
is decoded: O(1) in the number of callers, no lock, time from ``time.monotonic``. A caller's
key never appears in a message or a metric; its name does.

Once callers are configured, a request must not do better by hiding who sent it: a key no
caller has is refused (401), and a request without a key is refused too unless
``anonymous_rate_per_s`` admits it, then at that rate and at low priority.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter

from streamrec.plumbing.config import PRIORITIES, CallerEntry, ServingConfig
from streamrec.serving.errors import ApiError

ANONYMOUS = "anonymous"
OUTCOMES = ("admitted", "over_quota", "shed", "refused")


class OverQuota(ApiError):
    """A 429 whose ``Retry-After`` is when the caller's bucket holds a request again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(429, message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # whole seconds (RFC 9110)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", b"application/json"), (b"retry-after", str(self.retry_after_s).encode())]


@dataclass(frozen=True)
class Admission:
    """An admitted request: its caller's name and the priority it runs at."""

    caller: str
    priority: str


class _Bucket:
    """One caller's token bucket (rate 0: no quota) and counts."""

    def __init__(self, name: str, rate: float, burst: int, priority: str, counter: Counter) -> None:
        self.name, self.rate, self.rank = name, rate, PRIORITIES.index(priority)
        # burst 0: one second's worth, and at least one request (a rate below 1/s still admits)
        self.capacity = float(burst) if burst > 0 else max(rate, 1.0)
        self.tokens, self.last = self.capacity, None
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.counters = {outcome: counter.labels(name, outcome) for outcome in OUTCOMES}

    def take(self, now: float) -> float:
        """Take one request's token; returns 0, or the seconds until one is there (none taken)."""
        if self.rate <= 0:
            return 0.0
        if self.last is not None:
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return (1 - self.tokens) / self.rate
        self.tokens -= 1
        return 0.0

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.counters[outcome].inc()


class Callers:
    """Admission of predict requests by caller (``caller_header``'s API key) and priority."""

    def __init__(self, entries: Iterable[CallerEntry], caller_header: str, priority_header: str,
                 anonymous_rate_per_s: float, shed_low_priority_at: float, *, registry: CollectorRegistry) -> None:
        entries = list(entries)
        if any(c.name == ANONYMOUS for c in entries):
            raise ValueError(f"serving.callers: {ANONYMOUS!r} is the name of requests without a known key; name the caller otherwise")
        counter = Counter("streamrec_serving_caller_requests", "predict requests by caller and outcome: admitted, over_quota "
                          "(its token bucket was empty), shed (its priority is shed at the queue's fill), refused (an unknown "
                          "or missing key, under anonymous)",
                          ["caller", "outcome"], registry=registry)
        self._by_key = {c.key.encode(): _Bucket(c.name, c.rate_per_s, c.burst, c.priority, counter) for c in entries}
        # without callers every request is anonymous and no one is outranked: normal priority
        self._anonymous = _Bucket(ANONYMOUS, anonymous_rate_per_s, 0, "low" if entries else "normal", counter)
        self._caller_header, self._priority_header = caller_header.lower().encode(), priority_header.lower().encode()
        self.caller_header, self.priority_header = caller_header, priority_header
        # the queue fill at which each priority is shed: low first, normal halfway to full, high never here
        self.shed_at = (shed_low_priority_at, (1 + shed_low_priority_at) / 2, math.inf)

    @classmethod
    def from_config(cls, serving: ServingConfig, registry: CollectorRegistry) -> Callers:
        return cls(serving.callers, serving.caller_header, serving.priority_header, serving.anonymous_rate_per_s,
                   serving.shed_low_priority_at, registry=registry)

    def admit(self, headers: list[tuple[bytes, bytes]], queue_fill: float, now: float | None = None) -> Admission:
        """Admit one request (ASGI raw headers, lower-case names; ``queue_fill``: queued instances
        / serving.max_queue_instances), or raise ApiError: 400 for a bad priority header, 429
        when its priority is shed at this fill or its caller is over quota, 401 for a key no
        caller has or a missing key that callers must send (see the module's docstring)."""
        key, priority = self._read(headers)
        asked = None if priority is None else self._rank(priority)
        bucket = self._bucket(key)
        rank = bucket.rank if asked is None else min(bucket.rank, asked)
        if queue_fill >= self.shed_at[rank]:
            bucket.count("shed")
            raise ApiError(429, f"overloaded: the queue is {queue_fill:.0%} full; {PRIORITIES[rank]}-priority requests are "
                                f"shed past {self.shed_at[rank]:.0%} (serving.shed_low_priority_at), higher ones still run")
        wait = bucket.take(time.monotonic() if now is None else now)
        if wait:
            bucket.count("over_quota")
            raise OverQuota(f"caller {bucket.name!r} is over its quota of {bucket.rate:g} requests/s, burst "
                            f"{bucket.capacity:g} ({self._set_by(bucket.name)})", wait)
        bucket.count("admitted")
        return Admission(bucket.name, PRIORITIES[rank])

    def _read(self, headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
        """The request's caller key and priority header (400 when one is repeated)."""
        key = priority = None
        for name, value in headers:
            if name == self._caller_header:
                if key is not None:
                    raise _twice(self.caller_header)
                key = value
            elif name == self._priority_header:
                if priority is not None:
                    raise _twice(self.priority_header)
                priority = value
        return key, priority

    def _bucket(self, key: bytes | None) -> _Bucket:
        """The caller of ``key``; the anonymous one where callers are not configured, or where
        no key is sent and ``anonymous_rate_per_s`` admits such requests; else 401."""
        if not self._by_key:
            return self._anonymous
        if key is not None:
            bucket = self._by_key.get(key)
            if bucket is None:
                self._anonymous.count("refused")
                raise ApiError(401, f"unknown API key in header {self.caller_header}: send the key of a caller of "
                                    "serving.callers")
            return bucket
        if self._anonymous.rate <= 0:
            self._anonymous.count("refused")
            raise ApiError(401, f"no API key: send your caller's key in header {self.caller_header}; requests without one "
                                "are refused while serving.anonymous_rate_per_s is 0")
        return self._anonymous

    def _rank(self, value: bytes) -> int:
        text = value.decode("latin-1").strip().lower()
        if text not in PRIORITIES:
            raise ApiError(400, f"header {self.priority_header}: {text[:32]!r} is not one of {', '.join(PRIORITIES)}")
        return PRIORITIES.index(text)

    def _set_by(self, name: str) -> str:
        if name == ANONYMOUS:
            return f"serving.anonymous_rate_per_s: requests without a caller's key in {self.caller_header}"
        return "serving.callers"

    def counts(self) -> dict[str, dict[str, int]]:
        """Requests by caller name and outcome, since start (as the Prometheus counter)."""
        return {b.name: dict(b.counts) for b in (*self._by_key.values(), self._anonymous)}


def _twice(header: str) -> ApiError:
    return ApiError(400, f"more than one {header} header: send exactly one")

