"""Kafka clients with the settings streamrec relies on and errors a person can act on."""

from __future__ import annotations

from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from kafka.net.compat import KafkaNetClient


class BusUnavailable(RuntimeError):
    """No Kafka broker answered at the configured bootstrap address."""


def _unreachable(bootstrap: str, timeout_s: float, exc: BaseException) -> BusUnavailable:
    return BusUnavailable(
        f"cannot reach Kafka at {bootstrap} within {timeout_s:g}s ({type(exc).__name__}: {exc}). "
        "Start the embedded broker with `streamrec kafka up`, or point --bootstrap at a running cluster."
    )


def _connect(factory, settings: dict[str, Any], bootstrap: str, timeout_s: float) -> Any:
    """Build a client, waiting up to ``timeout_s`` for the first broker to answer. A client
    that cannot bootstrap is closed here: kafka-python starts its network thread before it
    bootstraps and leaves it running when the constructor raises, so a caller that retries
    through a broker outage would gain a thread per attempt."""
    started: list[KafkaNetClient] = []

    def network_client(**configs: Any) -> KafkaNetClient:
        client = KafkaNetClient(**configs)
        started.append(client)
        return client

    settings = {"bootstrap_servers": bootstrap, "bootstrap_timeout_ms": int(timeout_s * 1000), "kafka_client": network_client, **settings}
    try:
        return factory(**settings)
    except (KafkaError, OSError) as exc:
        for client in started:
            client.close()
        raise _unreachable(bootstrap, timeout_s, exc) from None


# Back on a restarted broker within a second (the Java client's default), not kafka-python's
# 30 s, which could outlast a short delivery timeout or a consumer's patience.
RECONNECT_BACKOFF_MAX_MS = 1000

# A producer gives up on a record this many connect timeouts after send(): 120 s (kafka-python's
# default) at the default kafka.connect_timeout_s, so a broker restart is ridden out.
DELIVERY_TIMEOUTS = 6


def make_producer(bootstrap: str, timeout_s: float = 20.0, **overrides: Any) -> KafkaProducer:
    """A producer that waits for the broker's ack and retries for ``DELIVERY_TIMEOUTS × timeout_s``.

    A record it then gives up on fails its future: every caller counts those (errbacks),
    so nothing is lost silently.
    """
    request_timeout_ms = int(max(timeout_s, 5) * 1000)
    linger_ms = 10
    settings: dict[str, Any] = dict(
        acks="all",
        retries=2**31 - 1,  # retried until the delivery timeout, as Java's clients do: a count runs out in a second or two
        linger_ms=linger_ms,
        batch_size=512 * 1024,
        max_request_size=8 * 1024 * 1024,
        request_timeout_ms=request_timeout_ms,
        delivery_timeout_ms=max(int(DELIVERY_TIMEOUTS * timeout_s * 1000), request_timeout_ms + linger_ms),
        reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
    )
    settings.update(overrides)
    return _connect(KafkaProducer, settings, bootstrap, timeout_s)


def make_consumer(bootstrap: str, *topics: str, group_id: str | None, timeout_s: float = 20.0, **overrides: Any) -> KafkaConsumer:
    """A consumer with manual commits (callers commit after their work is durable)."""
    settings: dict[str, Any] = dict(
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
    )
    settings.update(overrides)
    return _connect(lambda **kw: KafkaConsumer(*topics, **kw), settings, bootstrap, timeout_s)


def make_admin(bootstrap: str, timeout_s: float = 20.0) -> KafkaAdminClient:
    return _connect(KafkaAdminClient, {"request_timeout_ms": int(max(timeout_s, 5) * 1000)}, bootstrap, timeout_s)
