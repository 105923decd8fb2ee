"""Plumbing every part uses, above the contracts only: configuration (``config``, the packaged
``defaults.toml``, ``units``), Kafka clients, topics and the embedded broker (``bus``), and
a reader-writer lock (``locks``)."""
