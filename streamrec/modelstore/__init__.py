"""The model store: published versions (full and delta), the rollback pin, the one writer's
lease, garbage collection, verification and compaction, on any ``pyarrow.fs`` root.

- ``files``: :class:`StoreFiles`, one model's files on a ``pyarrow.fs`` root;
- ``store``: :class:`ModelStore`, the reading side (LATEST, chains, pins, verify, load, gc);
- ``writer``: :class:`VersionWriter`, the writing side (publish, sharded commits, compact);
- ``lease``: the writer lease with its fencing token;
- ``report``: ``streamrec store ls | verify``.
"""
