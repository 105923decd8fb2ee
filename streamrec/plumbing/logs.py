"""How every streamrec process logs: one line format, and kafka-python kept quiet.

kafka-python logs each connection, metadata refresh, coordinator change and retry (INFO to
ERROR), dozens of lines for one consumer group join; streamrec's own messages say what a
person needs (an unreachable cluster, a lost record). ``-v`` shows kafka-python's too.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def quiet_kafka(verbose: bool = False) -> None:
    """kafka-python's loggers at CRITICAL (DEBUG when ``verbose``)."""
    logging.getLogger("kafka").setLevel(logging.DEBUG if verbose else logging.CRITICAL)


def configure_logging(verbose: bool = False, level: int = logging.INFO, fmt: str = LOG_FORMAT) -> None:
    """The root logger at ``level`` (DEBUG when ``verbose``) in ``fmt``, kafka-python quiet."""
    logging.basicConfig(level=logging.DEBUG if verbose else level, format=fmt)
    quiet_kafka(verbose)
