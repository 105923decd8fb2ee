"""embedding: dynamic embedding tables over GPU HBM / CPU DRAM / SSD, the training and
serving hot path.

A table (``table.EmbeddingTable``) speaks a few verbs, as NVIDIA HierarchicalKV's does:
``find_or_insert`` (training pull: rows created/admitted), ``apply_gradients`` (the fused
optimizer), ``find`` (read; never creates rows, unknown ids read as zeros), ``upsert`` and
``erase`` (a delta onto a serving copy), ``export`` / ``export_all`` (rows for snapshots
and checkpoints; ``load_rows`` restores them). ``collection.EmbeddingCollection`` speaks
them for many tables at once and is the only entry streamrec.model uses;
``sharded.ShardedCollection`` speaks the training verbs for tables spread over ranks.

Modules:
- table: ``TableConfig``, ``EmbeddingTable`` and its verbs;
- tiers: the GPU cache, DRAM and SSD tiers of one table, read in place;
- placement: bring-up, eviction and spill between the tiers; spill: which DRAM rows spill;
- tracking: what the next delta holds, and expiry;
- collection, grouped (table-batched launches), sharded (rows over ranks);
- snapshot (publishing), checkpoint_files (checkpoint directory);
- tier_rows (one tier's rows + hash index), hash_index, hash_layout, host_memory, ssd,
  admission, optimizers, budget, unique, kernels and optimizer_kernels (Triton).
docs/ps.md.
"""
