"""The serving node, in four rooms whose calls go only down (pyproject.toml's layers, checked
by import-linter):

- ``http``: the HTTP app, its routes, the torch-free front-end processes and ``streamrec serve``;
- ``node``: :class:`ServingNode`, every served model and what they share;
- ``access``: which model answers (routing, experiments), callers' quotas, the prediction log;
- ``runtime``: one served model (its model runtime, versions, batcher and runner), the request
  decoders and the front-end <-> serving process link;
- ``features``: the online feature store the by-ids requests are assembled from;
- ``errors`` and ``by_ids``: the errors and the by-ids query every room shares.
"""
