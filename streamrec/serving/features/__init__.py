"""The online feature store: ``online_features`` tails the features topic into the columnar
``entity_store`` (``id_index``, ``time_lists``, ``history_rows``) and assembles by-ids batches;
windowed counts on the host (``counter_cache``, ``segment_counts``) or the device
(``device_counts``); snapshots (``feature_snapshot``)."""
