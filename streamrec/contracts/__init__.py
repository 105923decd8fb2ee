"""The contracts between the parts, at the bottom of the layering: they import no other package
of streamrec.

- ``events``, ``validation_spec``: the raw event schema on ``streamrec.events`` and its checks;
- ``feature_spec``: the one declaration of a labelled sample's fields (``[features]`` config);
- ``sample_wire``: the samples' encoding on ``streamrec.samples`` and the checks every consumer applies;
- ``feature_state``: the Flink job's per-entity state on ``streamrec.features``;
- ``delta``: the files of a published model version (sparse and dense Arrow files).
"""
