"""The model store: published versions (full and delta), the rollback pin, the one writer's
lease, garbage collection, verification and compaction, on any ``pyarrow.fs`` root.

- ``store``: :class:`ModelStore` (publish, load, chains, pins, gc, compact);
- ``lease``: the writer lease with its fencing token;
- ``report``: ``streamrec store ls | verify``.
"""
