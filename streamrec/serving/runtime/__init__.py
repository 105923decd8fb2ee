"""The model runtime: one served model's engine (``engine``), its versions (``state``,
``version``, ``watcher``), batching (``batcher``) and execution (``runner``), its metrics, the
predict-body decoders (``request``) and the front-end <-> engine link (``messages``, ``ipc``)."""
