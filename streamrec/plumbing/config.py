"""One configuration for every command: packaged defaults < TOML file < environment < flags.

Defaults live only in ``defaults.toml`` (shipped in this package) so there is one
place to read them; the dataclasses below give them types and reject unknown keys,
so a typo in a config file is an error instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Mapping

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.plumbing.units import SizeError, parse_bytes

ENV_PREFIX = "STREAMREC_"
CONFIG_ENV = "STREAMREC_CONFIG"
LOCAL_CONFIG = Path("streamrec.toml")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap: str
    embedded_host: str
    embedded_port: int
    embedded_brokers: int
    embedded_heap_mb: int
    data_dir: str
    partitions: int
    replication_factor: int
    connect_timeout_s: float

    @property
    def embedded(self) -> bool:
        """True when no external cluster is configured and the embedded broker is used."""
        return not self.bootstrap.strip()

    @property
    def bootstrap_servers(self) -> str:
        """The address every client connects to, embedded or external."""
        if self.embedded:
            return ",".join(f"{self.embedded_host}:{self.embedded_port + i}" for i in range(self.embedded_brokers))
        return self.bootstrap.strip()


@dataclass(frozen=True)
class TopicsConfig:
    events: str
    dlq: str
    samples: str
    model_updates: str
    truth: str
    features: str
    predictions: str

    def all(self) -> list[str]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


@dataclass(frozen=True)
class FlinkConfig:
    jars_dir: str
    jobmanager: str
    rest_port: int
    job_name: str
    group_id: str
    parallelism: int
    state_backend: str
    state_cache_keys: int
    jvm_options: str
    checkpoint_dir: str
    checkpoint_interval_s: float
    delivery: str
    out_of_orderness_ms: int
    watermark_interval_ms: int
    buffer_timeout_ms: int
    restart_max_backoff_s: float
    idle_timeout_s: float
    feature_state: bool
    feature_bucket_s: int

    def resolved_jars_dir(self) -> Path:
        if self.jars_dir:
            return Path(self.jars_dir).expanduser()
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cache / "streamrec" / "flink-jars"


@dataclass(frozen=True)
class WorldConfig:
    """Parameters of the generator's synthetic world (streamrec/generator/world.py); defaults
    live in defaults.toml [generator.world]."""

    n_users: int
    n_items: int
    n_categories: int
    n_advertisers: int
    latent_dim: int
    max_slots: int
    target_ctr: float
    zipf_exponent: float
    user_zipf_exponent: float
    position_decay: float
    sequence_weight: float
    sequence_half_life_s: float
    drift_time_constant_s: float
    drift_scale: float
    new_items_per_s: float
    mean_item_lifetime_s: float
    trend_every_s: float
    trend_duration_s: float
    trend_strength: float
    median_click_delay_s: float

    def validate(self) -> None:
        checks = {
            "n_users": self.n_users >= 1,
            "n_items": self.n_items >= self.max_slots,
            "n_categories": self.n_categories >= 2,
            "n_advertisers": self.n_advertisers >= 1,
            "latent_dim": self.latent_dim >= 1,
            "max_slots": self.max_slots >= 1,
            "target_ctr": 0.0 < self.target_ctr < 0.5,
            "drift_scale": self.drift_scale >= 0.0,
            "drift_time_constant_s": self.drift_time_constant_s > 0,
            "sequence_half_life_s": self.sequence_half_life_s > 0,
            "mean_item_lifetime_s": self.mean_item_lifetime_s > 0,
            "trend_every_s": self.trend_every_s > 0,
            "trend_duration_s": self.trend_duration_s > 0,
            "median_click_delay_s": self.median_click_delay_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid world config: {', '.join(bad)} out of range ({self})")


@dataclass(frozen=True)
class GeneratorConfig:
    seed: int
    rate: float
    duration_s: float
    bad_fraction: float
    max_disorder_ms: int
    world: WorldConfig


@dataclass(frozen=True)
class ModelConfig:
    name: str
    embedding_dim: int
    history_len: int
    attention_hidden: int
    cross_layers: int
    mlp: str
    sparse_optimizer: str
    sparse_lr: float
    dense_lr: float
    admit_after: int
    ttl_s: float

    @property
    def mlp_widths(self) -> tuple[int, ...]:
        try:
            widths = tuple(int(w) for w in self.mlp.split(",") if w.strip())
        except ValueError:
            raise ConfigError(f"model.mlp must be comma-separated integers, got {self.mlp!r}") from None
        if not widths or min(widths) < 1:
            raise ConfigError(f"model.mlp must name at least one positive width, got {self.mlp!r}")
        return widths


class ByteSize(int):
    """A size in bytes; the config may write it as "4GiB", "512MiB", "1.5GB" (units.py). The
    embedding store turns the ``[ps]`` budgets into rows per table (embedding/budget.py)."""


class AutoOrCount(str):
    """"auto" or a whole number (a TOML integer is taken as its digits); the setting's own
    check says which numbers it allows."""


@dataclass(frozen=True)
class PsConfig:
    hbm_bytes: ByteSize
    dram_bytes: ByteSize


# settings replaced by others: an old config gets told what to set instead
REPLACED_KEYS = {"model.dram_rows": "[ps] dram_bytes (a size such as 16GiB)",
                 "model.gpu_cache_rows": "[ps] hbm_bytes (a size such as 4GiB)"}


@dataclass(frozen=True)
class TrainerConfig:
    model_store: str
    work_dir: str
    batch_size: int
    publish_interval_s: float
    full_every: int
    compact_every: int
    keep_fulls: int
    publish_rows_per_step: int
    checkpoint_interval_s: float
    group: str
    device: str
    cuda_graphs: bool
    prefetch_batches: int
    max_batch_delay_ms: int
    eval_window: int
    warmup_samples: int
    frozen_baseline: bool
    metrics_port: int
    metrics_host: str
    progress_interval_s: float
    collective_timeout_s: float
    pipeline_exchange: bool
    lease_s: float
    max_publish_failures: int
    rejected_keep_mb: int
    replicate_below_rows: int
    table_rows: str
    placement: str

    @property
    def estimated_rows(self) -> dict[str, int]:
        """``table_rows`` ("user=50000000,category=2000") as table -> rows."""
        return {name: _count(value, "trainer.table_rows") for name, value in _pairs(self.table_rows, "trainer.table_rows").items()}

    @property
    def placement_overrides(self) -> dict[str, str]:
        """``placement`` ("context=replicated,user=sharded") as table -> placement."""
        out = _pairs(self.placement, "trainer.placement")
        bad = {n: p for n, p in out.items() if p not in ("replicated", "sharded")}
        if bad:
            raise ConfigError(f"trainer.placement: each table is 'replicated' or 'sharded', got {bad}")
        return out

    @property
    def replicates(self) -> bool:
        """Whether this config can replicate a table (placement.py's planner, on several ranks)."""
        return self.replicate_below_rows > 0 or "replicated" in self.placement_overrides.values()


def _pairs(text: str, key: str) -> dict[str, str]:
    """"a=1, b=2" as {"a": "1", "b": "2"} (empty: none)."""
    out = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise ConfigError(f"{key} must be comma-separated table=value pairs, got {text!r}")
        out[name.strip()] = value.strip()
    return out


def _count(value: str, key: str) -> int:
    try:
        rows = int(value)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not a number of rows") from None
    if rows < 0:
        raise ConfigError(f"{key}: rows must be >= 0, got {rows}")
    return rows


@dataclass(frozen=True)
class ServedModelEntry:
    """One ``[[serving.models]]`` table: a model this node serves."""

    name: str
    model_store: str = ""  # "": serving.model_store


@dataclass(frozen=True)
class VariantEntry:
    """One variant of an experiment: the model that scores its users and its share of them."""

    name: str
    model: str
    share: float


@dataclass(frozen=True)
class ExperimentEntry:
    """One ``[[serving.experiments]]`` table (docs/experiments.md). A user's variant is a stable
    hash of (layer salt, user id): the same on every node and after restarts."""

    name: str
    variants: tuple[VariantEntry, ...]
    salt: str = ""  # "": the layer's name (so experiments in different layers are orthogonal)
    layer: str = ""  # "": a layer of its own; experiments of one layer take disjoint user ranges
    range_start: float = 0.0  # the slice of the layer's users in the experiment, [start, end)
    range_end: float = 1.0
    shadow_model: str = ""  # "": none; else this model also scores shadow_share of requests, off the response path
    shadow_share: float = 0.0


@dataclass(frozen=True)
class CallerEntry:
    """One ``[[serving.callers]]`` table: an API key's quota and priority."""

    name: str
    key: str
    rate_per_s: float  # predict requests a second, sustained (0: no quota)
    burst: int = 0  # requests above the rate it may send at once (0: one second's worth)
    priority: str = "normal"  # low | normal | high: which callers are shed first under overload


@dataclass(frozen=True)
class ServingConfig:
    host: str
    port: int
    model_store: str
    device: str
    admin_token: str
    max_batch: int
    max_delay_us: int
    workers: AutoOrCount  # see batch_workers
    frontends: int
    switch_interval_us: int
    max_instances: int
    max_body_bytes: int
    max_queue_instances: int
    queue_timeout_ms: int
    keep_alive_s: float
    read_timeout_s: float
    max_connections: int
    poll_interval_s: float
    undo_depth: int
    compile: str
    batch_buckets: str
    history_buckets: str
    max_extra_buckets: int
    follow_updates: bool
    feature_store: bool
    feature_store_memory_mb: int
    feature_store_dir: str
    feature_store_ready_timeout_s: float
    features_max_lag_s: float
    candidate_counts: str
    feature_snapshot: str
    feature_snapshot_interval_s: float
    models: tuple[ServedModelEntry, ...]
    experiments: tuple[ExperimentEntry, ...]
    callers: tuple[CallerEntry, ...]
    caller_header: str
    priority_header: str
    anonymous_rate_per_s: float
    shed_low_priority_at: float
    prediction_log: bool
    prediction_log_queue: int

    def batch_workers(self, device_type: str) -> int:
        """``serving.workers`` as a count: "auto" is 0 on CUDA (each batch on the event loop's
        thread: no GIL hand-offs, measured faster on GPUs, bench/RESULTS.md "Predict by ids")
        and 1 on CPU (a worker thread, so the loop keeps reading while a slow CPU batch runs)."""
        if self.workers == "auto":
            return 0 if device_type == "cuda" else 1
        return int(self.workers)


@dataclass(frozen=True)
class Config:
    kafka: KafkaConfig
    topics: TopicsConfig
    flink: FlinkConfig
    features: FeatureSpec
    generator: GeneratorConfig
    model: ModelConfig
    ps: PsConfig
    trainer: TrainerConfig
    serving: ServingConfig
    source: str = "defaults"  # which files contributed, for `--help`/status output


def _deep_merge(base: dict, extra: Mapping, where: str) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if key not in out:
            if f"{where}{key}" in REPLACED_KEYS:
                raise ConfigError(f"config key '{where}{key}' is no longer read: set {REPLACED_KEYS[where + key]} instead")
            raise ConfigError(f"unknown config key '{where}{key}' (known: {', '.join(sorted(base))})")
        if isinstance(out[key], dict):
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key '{where}{key}' must be a table, got {value!r}")
            out[key] = _deep_merge(out[key], value, f"{where}{key}.")
        else:
            out[key] = value
    return out


def _coerce(value: Any, target: Any, name: str) -> Any:
    """Convert TOML/env/flag values to the field's type; strings come from env and flags."""
    if target is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
        elif isinstance(value, bool):
            return value
    elif target is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif target is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif target is str:
        if isinstance(value, str):
            return value
    elif target is AutoOrCount:
        if isinstance(value, int) and not isinstance(value, bool):
            return AutoOrCount(value)
        if isinstance(value, str):
            return AutoOrCount(value.strip())
    elif target is ByteSize:
        try:
            return ByteSize(parse_bytes(value, name))
        except SizeError as exc:
            raise ConfigError(str(exc)) from None
    elif typing.get_origin(target) is tuple and dataclasses.is_dataclass(typing.get_args(target)[0]):  # [[tables]]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, Mapping) for v in value):
            raise ConfigError(f"config key '{name}' must be a list of tables ([[{name}]]), got {value!r}")
        return tuple(_build_entry(typing.get_args(target)[0], v, f"{name}[{i}].") for i, v in enumerate(value))
    elif typing.get_origin(target) is tuple:  # tuple[int, ...]: a TOML array, or "60,600" from env/flags
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)):
            try:
                return tuple(_coerce(v.strip() if isinstance(v, str) else v, typing.get_args(target)[0], name) for v in items)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{name}' must be a list of {typing.get_args(target)[0].__name__}, got {value!r}")
    else:
        return value
    raise ConfigError(f"config key '{name}' must be {target.__name__}, got {value!r}")


def _build(cls: type, data: Mapping, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name == "source":
            continue
        name = f"{where}{field.name}"
        if field.name not in data:
            raise ConfigError(f"missing config key '{name}'")
        target = hints[field.name]
        if dataclasses.is_dataclass(target):
            kwargs[field.name] = _build(target, data[field.name], name + ".")
        else:
            kwargs[field.name] = _coerce(data[field.name], target, name)
    return cls(**kwargs)


def _build_entry(cls: type, data: Mapping, where: str) -> Any:
    """One table of a list of tables: unknown keys are errors, missing ones take the field's default."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)} (known: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            kwargs[field.name] = _coerce(data[field.name], hints[field.name], where + field.name)
        elif field.default is dataclasses.MISSING:
            raise ConfigError(f"missing config key '{where}{field.name}'")
    return cls(**kwargs)


def _env_overrides(environ: Mapping[str, str]) -> dict:
    """STREAMREC_KAFKA__BOOTSTRAP=x -> {"kafka": {"bootstrap": "x"}}."""
    tree: dict = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV or "__" not in key:
            continue
        path = key[len(ENV_PREFIX):].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _dotted_overrides(overrides: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def default_config_text() -> str:
    return files("streamrec.plumbing").joinpath("defaults.toml").read_text()


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load the effective configuration.

    ``path``: an explicit TOML file (must exist); otherwise ``$STREAMREC_CONFIG``, otherwise
    ``./streamrec.toml`` if present. ``overrides``: dotted keys from command-line flags;
    ``None`` values are ignored so unset flags never mask the file.
    """
    environ = os.environ if environ is None else environ
    data = tomllib.loads(default_config_text())
    sources = ["defaults"]
    chosen = path or environ.get(CONFIG_ENV) or (LOCAL_CONFIG if LOCAL_CONFIG.exists() else None)
    if chosen:
        chosen = Path(chosen)
        if not chosen.is_file():
            raise ConfigError(f"config file {chosen} does not exist")
        try:
            file_data = tomllib.loads(chosen.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {chosen} is not valid TOML: {exc}") from exc
        data = _deep_merge(data, file_data, "")
        sources.append(str(chosen))
    env_tree = _env_overrides(environ)
    if env_tree:
        data = _deep_merge(data, env_tree, "")
        sources.append("environment")
    flag_tree = _dotted_overrides(overrides or {})
    if flag_tree:
        data = _deep_merge(data, flag_tree, "")
        sources.append("flags")
    config = _build(Config, data, "")
    validate(config)
    return dataclasses.replace(config, source=" < ".join(sources))


def validate(config: Config) -> None:
    """Every check of a value against its range or the other values, in one place: a bad
    setting fails when the configuration is loaded, before any command starts work."""
    problems: list[str] = []
    try:
        config.features.validate()
    except ValueError as exc:
        problems.append(f"[features]: {exc}")
    m, s, f = config.model, config.serving, config.flink
    if not 1 <= m.history_len <= config.features.history_len:
        problems.append(f"model.history_len ({m.history_len}) must be within 1..features.history_len ({config.features.history_len})")
    try:
        m.mlp_widths
    except ConfigError as exc:
        problems.append(str(exc))
    if f.delivery not in ("exactly-once", "at-least-once"):
        problems.append(f"flink.delivery must be exactly-once or at-least-once, got {f.delivery!r}")
    if f.state_backend not in ("rocksdb", "hashmap"):
        problems.append(f"flink.state_backend must be rocksdb or hashmap, got {f.state_backend!r}")
    try:
        check_serving_mode(s.compile)
    except ConfigError as exc:
        problems.append(str(exc))
    t = config.trainer
    if t.replicate_below_rows < 0:
        problems.append(f"trainer.replicate_below_rows must be >= 0 (0: no table replicated by size), got {t.replicate_below_rows}")
    try:
        t.estimated_rows, t.placement_overrides
        if t.pipeline_exchange and t.replicates:
            problems.append("trainer.pipeline_exchange cannot run with replicated tables (trainer.replicate_below_rows, "
                            "trainer.placement): turn one of them off")
    except ConfigError as exc:
        problems.append(str(exc))
    if config.trainer.compact_every < 0:
        problems.append(f"trainer.compact_every must be >= 0 (0: never), got {config.trainer.compact_every}")
    if config.trainer.max_batch_delay_ms < 1:
        problems.append(f"trainer.max_batch_delay_ms must be >= 1, got {config.trainer.max_batch_delay_ms}")
    if config.trainer.lease_s <= 0:
        problems.append(f"trainer.lease_s must be > 0, got {config.trainer.lease_s}")
    if config.trainer.rejected_keep_mb < 1:
        problems.append(f"trainer.rejected_keep_mb must be >= 1, got {config.trainer.rejected_keep_mb}")
    if config.trainer.max_publish_failures < 1:
        problems.append(f"trainer.max_publish_failures must be >= 1, got {config.trainer.max_publish_failures}")
    if f.feature_bucket_s < 1:
        problems.append(f"flink.feature_bucket_s must be >= 1, got {f.feature_bucket_s}")
    for name in ("watermark_interval_ms", "buffer_timeout_ms"):
        if getattr(f, name) < 1:  # 0 would flush or emit per record: a severe throughput loss
            problems.append(f"flink.{name} must be >= 1, got {getattr(f, name)}")
    if f.restart_max_backoff_s < 1:
        problems.append(f"flink.restart_max_backoff_s must be >= 1, got {f.restart_max_backoff_s}")
    if s.feature_store_memory_mb < 1:
        problems.append(f"serving.feature_store_memory_mb must be >= 1, got {s.feature_store_memory_mb}")
    if s.features_max_lag_s <= 0:
        problems.append(f"serving.features_max_lag_s must be > 0, got {s.features_max_lag_s}")
    if s.feature_snapshot_interval_s < 0:
        problems.append(f"serving.feature_snapshot_interval_s must be >= 0 (0: only at shutdown), got {s.feature_snapshot_interval_s}")
    if s.switch_interval_us <= 0:
        problems.append(f"serving.switch_interval_us must be > 0, got {s.switch_interval_us}")
    if s.frontends < 0:
        problems.append(f"serving.frontends must be >= 0, got {s.frontends}")
    if s.candidate_counts not in CANDIDATE_COUNTS:
        problems.append(f"serving.candidate_counts must be one of {', '.join(CANDIDATE_COUNTS)}, got {s.candidate_counts!r}")
    if s.workers != "auto" and not (s.workers.isdigit() and int(s.workers) >= 0):
        problems.append(f"serving.workers must be 'auto' or a whole number >= 0, got {s.workers!r}")
    if s.max_queue_instances < s.max_instances:
        problems.append(f"serving.max_queue_instances ({s.max_queue_instances}) must be >= serving.max_instances ({s.max_instances})")
    for name in ("keep_alive_s", "read_timeout_s", "max_connections"):
        if getattr(s, name) <= 0:
            problems.append(f"serving.{name} must be > 0, got {getattr(s, name)}")
    if s.queue_timeout_ms * 1000 <= s.max_delay_us:  # else a request waiting out the batching window is dropped
        problems.append(f"serving.queue_timeout_ms ({s.queue_timeout_ms}) must be longer than serving.max_delay_us ({s.max_delay_us} us)")
    for name in ("batch_buckets", "history_buckets"):
        try:
            parse_sizes(getattr(s, name), f"serving.{name}")
        except ConfigError as exc:
            problems.append(str(exc))
    problems.extend(_model_access_problems(config))
    if problems:
        raise ConfigError("; ".join(problems))


PRIORITIES = ("low", "normal", "high")


def served_model_names(config: Config) -> list[str]:
    """The models a serving node serves: its [[serving.models]], or model.name."""
    return [m.name for m in config.serving.models] or [config.model.name]


def _model_access_problems(config: Config) -> list[str]:
    """Checks of [[serving.models]], [[serving.experiments]] and [[serving.callers]]."""
    s, problems = config.serving, []
    names = served_model_names(config)
    if len(set(names)) != len(names):
        problems.append(f"serving.models: each model is listed once, got {names}")
    seen: set[str] = set()
    for e in s.experiments:
        where = f"serving.experiments '{e.name}'"
        if e.name in seen:
            problems.append(f"{where}: two experiments have that name")
        seen.add(e.name)
        problems.extend(f"{where}: {p}" for p in experiment_problems(e, names))
    ranges: dict[str, list[tuple[float, float, str]]] = {}
    for e in s.experiments:
        ranges.setdefault(e.layer or e.name, []).append((e.range_start, e.range_end, e.name))
    for layer, spans in ranges.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                problems.append(f"serving.experiments '{a}' and '{b}' share layer '{layer}' and overlapping user ranges")
    keys = [c.key for c in s.callers]
    if len(set(keys)) != len(keys) or len({c.name for c in s.callers}) != len(keys):
        problems.append("serving.callers: each caller has its own name and key")
    for c in s.callers:
        if not c.key or c.rate_per_s < 0 or c.burst < 0 or c.priority not in PRIORITIES:
            problems.append(f"serving.callers '{c.name}': needs a key, rate_per_s >= 0, burst >= 0 and priority in {PRIORITIES}")
    if s.anonymous_rate_per_s < 0:
        problems.append(f"serving.anonymous_rate_per_s must be >= 0 (0: refused once serving.callers are configured, "
                        f"else no quota), got {s.anonymous_rate_per_s}")
    if not 0 < s.shed_low_priority_at <= 1:
        problems.append(f"serving.shed_low_priority_at must be in (0, 1], got {s.shed_low_priority_at}")
    if s.prediction_log_queue < 1:
        problems.append(f"serving.prediction_log_queue must be >= 1, got {s.prediction_log_queue}")
    return problems


def experiment_problems(e: ExperimentEntry, models: list[str]) -> list[str]:
    """What is wrong with one experiment (also checked when one is changed at run time)."""
    problems = []
    if not e.name or not e.variants:
        problems.append("needs a name and at least one variant")
    if len({v.name for v in e.variants}) != len(e.variants):
        problems.append("each variant has its own name")
    if any(v.share <= 0 for v in e.variants) or abs(sum(v.share for v in e.variants) - 1) > 1e-6:
        problems.append(f"variant shares are > 0 and add up to 1, got {[v.share for v in e.variants]}")
    unknown = sorted({v.model for v in e.variants} - set(models) | ({e.shadow_model} - set(models) - {""}))
    if unknown:
        problems.append(f"model(s) {unknown} not served by this node (serving.models: {models})")
    if not 0 <= e.range_start < e.range_end <= 1:
        problems.append(f"range_start and range_end must satisfy 0 <= start < end <= 1, got {e.range_start}, {e.range_end}")
    if not 0 <= e.shadow_share <= 1 or (e.shadow_share > 0 and not e.shadow_model):
        problems.append("shadow_share is within [0, 1] and needs a shadow_model")
    return problems


CANDIDATE_COUNTS = ("auto", "device", "host")  # where by-ids candidates' windowed counts are computed
SERVING_MODES = ("auto", "eager", "compile", "graph", "compile+graph")


def check_serving_mode(mode: str) -> None:
    if mode not in SERVING_MODES:
        raise ConfigError(f"serving.compile must be one of {', '.join(SERVING_MODES)}; got {mode!r}")


def parse_sizes(text: str, name: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16): a sorted set of positive sizes."""
    try:
        sizes = tuple(sorted({int(s) for s in str(text).split(",") if s.strip()}))
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated positive integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"{name} must name at least one positive size, got {text!r}")
    return sizes
