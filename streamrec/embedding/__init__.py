"""ps: dynamic embedding tables over GPU HBM / CPU DRAM / SSD, and the model store.

Start at ``ps.table.EmbeddingTable`` (one table), ``ps.store.EmbeddingStore`` (many
tables, publish, checkpoint) and ``ps.model_store.ModelStore`` (versions). docs/ps.md.
"""
