"""streamrec: the shared home of the one CLI, configuration and the message-bus plumbing.

The four parts live in their own top-level packages: ``pipelines`` (events, samples,
Flink job, traffic generator), ``ps`` (embedding store, model store), ``trainer`` and
``serving``.
"""

__version__ = "0.1.0"
