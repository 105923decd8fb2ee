"""The CTR model that training and serving share.

- ``columns``: checked samples (or predict instances) as numpy columns, without torch;
- ``batch``: columns -> the tensors of one batch (ids per sparse table, dense features);
- ``network``: the dense part of the model (DIN attention, DCN-v2 cross, MLP) and its spec;
- ``sparse``: a batch's sparse lookups through the embedding collection -> the network's inputs;
- ``inference``: a published version loaded as a runnable model (dense module + embedding collection).

Layering (pyproject.toml, checked by import-linter): this package sits on ``embedding`` and
``modelstore`` (and on the feature spec of ``contracts``); ``trainer`` and ``serving`` build on
it and never import each other.
"""
