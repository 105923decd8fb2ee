"""The feature spec: the one place a sample's fields are declared.

A sample (``streamrec.samples``, schema version :data:`SAMPLE_VERSION`) is one impression's
ids and context, point-in-time features built from the events strictly before it, and its
label. What varies is :class:`FeatureSpec` (the ``[features]`` config section): the counter
windows, the behaviour-history length and the attribution window. Every other form of the
sample is derived from it here:

- the Arrow schema (:meth:`FeatureSpec.schema`; the reference builder, sample files);
- the Kafka wire decoder's required fields and checks (``sample_wire.py``);
- the trainer's and serving's feature columns (``model/columns.py``);
- serving's typed request decoder (``serving/runtime/request.py``);
- the Flink job's field table (:meth:`FeatureSpec.job_properties`, interpreted by
  ``SampleJson.java`` at job build: the job has no field name of its own).

Every published version records the spec it was trained with (manifest ``feature_spec``);
serving refuses a version whose spec differs from the one it was configured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

SAMPLE_VERSION = 1  # the sample schema's version: its fixed fields and encoding
COUNTER_ENTITIES = ("user", "item", "category")  # keyed counter stages of the job, in its order
COUNTED_EVENTS = ("imps", "clicks")  # what each counter counts, per window

# Roles of the fixed fields: "meta" (identifies the sample; optional in a predict instance),
# "feature" (a scalar input), "id" (a feature that is a sparse key), "history" (the
# behaviour sequence), "label" (training only). Counters are the spec's variable part.
_FIXED: tuple[tuple[str, pa.DataType, str], ...] = (
    ("sample_version", pa.int16(), "meta"),
    ("event_id", pa.string(), "meta"),
    ("request_id", pa.string(), "meta"),
    ("ts", pa.int64(), "feature"),
    ("user_id", pa.int64(), "id"),
    ("item_id", pa.int64(), "id"),
    ("position", pa.int32(), "feature"),
    ("device", pa.string(), "feature"),
    ("local_hour", pa.int32(), "feature"),
    ("category_id", pa.int64(), "id"),
    ("advertiser_id", pa.int64(), "id"),
    ("hist_item_ids", pa.list_(pa.int64()), "history"),
    ("hist_category_ids", pa.list_(pa.int64()), "history"),
)
_LABEL: tuple[tuple[str, pa.DataType, str], ...] = (
    ("label", pa.int8(), "label"),
    ("click_ts", pa.int64(), "label"),  # null unless label = 1
)


@dataclass(frozen=True)
class Field:
    name: str
    type: pa.DataType
    role: str  # meta | feature | id | history | counter | label


FIELDS = tuple(Field(*f) for f in _FIXED)
ID_COLUMNS = tuple(f.name for f in FIELDS if f.role == "id")
HISTORY_COLUMNS = tuple(f.name for f in FIELDS if f.role == "history")
# Scalar integer inputs of the model, in field order (the numpy/IPC column layout).
INT_COLUMNS = tuple(f.name for f in FIELDS if f.role in ("feature", "id") and pa.types.is_integer(f.type))
# Non-counter inputs a predict instance must carry (the meta fields are optional there).
INSTANCE_FIELDS = tuple(f.name for f in FIELDS if f.role != "meta")
REQUIRED_SAMPLE_FIELDS = ("sample_version", "event_id", *INSTANCE_FIELDS, "label")


@dataclass(frozen=True)
class FeatureSpec:
    """What the features look like; column names derive from it. Defaults: ``[features]`` in
    streamrec/defaults.toml (tests/test_config.py keeps the two equal)."""

    history_len: int = 50  # clicked items remembered per user
    windows_s: tuple[int, ...] = (60, 600)  # sliding windows of the counters, whole seconds
    attribution_window_s: float = 10.0  # click within this long after the impression -> label 1

    def validate(self) -> "FeatureSpec":
        problems = []
        if self.history_len < 1:
            problems.append(f"history_len must be >= 1, got {self.history_len}")
        if not self.windows_s:
            problems.append("windows_s must name at least one window")
        if any(not isinstance(w, int) or isinstance(w, bool) or w <= 0 for w in self.windows_s):
            problems.append(f"windows_s must be positive whole seconds (they name the counter columns), got {list(self.windows_s)}")
        elif len(set(self.windows_s)) != len(self.windows_s):
            problems.append(f"windows_s has a window twice: {list(self.windows_s)}")
        if not self.attribution_window_s > 0:
            problems.append(f"attribution_window_s must be > 0, got {self.attribution_window_s}")
        if problems:
            raise ValueError("invalid feature spec: " + "; ".join(problems))
        return self

    # ------------------------------------------------------------------ stored form
    def to_json(self) -> dict:
        """As stored in version manifests (``feature_spec``) and sent to serving front-ends."""
        return {"sample_version": SAMPLE_VERSION, "history_len": self.history_len, "windows_s": list(self.windows_s),
                "attribution_window_s": self.attribution_window_s}

    @classmethod
    def from_json(cls, data: dict) -> "FeatureSpec":
        version = data.get("sample_version", SAMPLE_VERSION)
        if version != SAMPLE_VERSION:
            raise ValueError(f"feature spec of sample schema v{version}; this build reads v{SAMPLE_VERSION}")
        return cls(int(data["history_len"]), tuple(int(w) for w in data["windows_s"]), float(data["attribution_window_s"])).validate()

    def differences(self, other: "FeatureSpec") -> list[str]:
        """What differs from ``other``, field by field (empty: the same spec)."""
        return [f"{name} {getattr(other, name)!r} vs {getattr(self, name)!r}"
                for name in ("history_len", "windows_s", "attribution_window_s") if getattr(self, name) != getattr(other, name)]

    # ------------------------------------------------------------------ derived forms
    @staticmethod
    def counter_name(entity: str, counted: str, window_s: int) -> str:
        return f"{entity}_{counted}_{window_s}s"

    def counter_columns(self) -> list[str]:
        """Counter columns in the order the job computes them: window, entity, imps/clicks."""
        return [self.counter_name(e, c, w) for w in self.windows_s for e in COUNTER_ENTITIES for c in COUNTED_EVENTS]

    def fields(self, with_label: bool = True) -> list[Field]:
        counters = [Field(name, pa.int32(), "counter") for name in self.counter_columns()]
        return [*FIELDS, *counters, *([Field(*f) for f in _LABEL] if with_label else [])]

    def feature_names(self) -> list[str]:
        """The model's inputs of one sample, in field order: what predict by ids assembles."""
        return [f.name for f in self.fields(with_label=False) if f.role != "meta"]

    def schema(self, with_label: bool = True) -> pa.Schema:
        """The sample schema; without the label (and click_ts) it is a predict instance's."""
        meta = {b"sample_version": str(SAMPLE_VERSION).encode(), b"feature_spec": repr(self).encode()}
        return pa.schema([(f.name, f.type) for f in self.fields(with_label)], metadata=meta)

    def job_properties(self) -> dict[str, str]:
        """The Flink job's field table (SampleJson.java writes these names, in this order)."""
        return {
            "sample_version": str(SAMPLE_VERSION),
            "sample_fields": ",".join(f.name for f in FIELDS),
            "counter_columns": ",".join(self.counter_columns()),
            "windows_s": ",".join(str(w) for w in self.windows_s),
            "attribution_ms": str(int(round(self.attribution_window_s * 1000))),
            "history_len": str(self.history_len),
        }
