"""The model runtime: one served model (:class:`ModelRuntime`, ``model_runtime``), its versions
(``state``, ``version``, ``watcher``), batching (``batcher``) and execution (``runner``), its
metrics, the predict-body decoders (``request``) and the front-end <-> serving process link
(``messages``, ``ipc``)."""
