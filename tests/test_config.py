"""Configuration precedence and validation: defaults < file < environment < flags."""

import pytest

from streamrec.plumbing.config import ConfigError, load_config


def test_defaults_load_with_documented_topic_names():
    cfg = load_config(environ={})
    assert cfg.kafka.embedded
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert cfg.topics.all() == [
        "streamrec.events", "streamrec.events.dlq", "streamrec.samples", "streamrec.model-updates", "streamrec.truth",
        "streamrec.features", "streamrec.predictions",
    ]
    assert cfg.generator.world.target_ctr == 0.03


def test_precedence_file_then_env_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[kafka]\npartitions = 7\nbootstrap = "file:1"\n[generator.world]\nn_users = 123\n')
    cfg = load_config(path, environ={})
    assert (cfg.kafka.partitions, cfg.kafka.bootstrap, cfg.generator.world.n_users) == (7, "file:1", 123)
    env = {"STREAMREC_KAFKA__BOOTSTRAP": "env:2", "STREAMREC_GENERATOR__WORLD__N_USERS": "456"}
    cfg = load_config(path, environ=env)
    assert (cfg.kafka.partitions, cfg.kafka.bootstrap, cfg.generator.world.n_users) == (7, "env:2", 456)
    cfg = load_config(path, {"kafka.bootstrap": "flag:3", "kafka.partitions": None}, environ=env)
    assert (cfg.kafka.partitions, cfg.kafka.bootstrap) == (7, "flag:3")
    assert not cfg.kafka.embedded and cfg.kafka.bootstrap_servers == "flag:3"
    assert cfg.source == f"defaults < {path} < environment < flags"


def test_config_file_from_environment_variable(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[kafka]\npartitions = 2\n")
    assert load_config(environ={"STREAMREC_CONFIG": str(path)}).kafka.partitions == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("[kafka]\nbootstarp = 'x'\n", "unknown config key 'kafka.bootstarp'"),
        ("[kafka]\npartitions = 'four'\n", "'kafka.partitions' must be int"),
        ("[kafka]\npartitions = true\n", "'kafka.partitions' must be int"),
        ("[nope]\n", "unknown config key 'nope'"),
        ("kafka = 3\n", "'kafka' must be a table"),
        ("[kafka\n", "not valid TOML"),
    ],
)
def test_bad_config_files_get_clear_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(path, environ={})


def test_bad_environment_value_is_an_error():
    with pytest.raises(ConfigError, match="kafka.embedded_port' must be int"):
        load_config(environ={"STREAMREC_KAFKA__EMBEDDED_PORT": "ninety"})


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", environ={})


def test_the_production_example_is_a_valid_configuration():
    """examples/production/streamrec.toml (docs/production.md) loads without unknown keys or wrong types."""
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parent.parent / "examples" / "production" / "streamrec.toml", environ={})
    assert not cfg.kafka.embedded and cfg.kafka.replication_factor == 3
    assert cfg.flink.jobmanager and cfg.serving.follow_updates
    assert cfg.trainer.model_store.startswith("s3://") and cfg.serving.model_store == cfg.trainer.model_store


def test_settings_objects_built_from_the_defaults_agree_with_their_constructor_defaults():
    """defaults.toml is the only place a default lives: a settings class may keep a constructor
    default (for tests and library use) only when it equals what the defaults file gives."""
    import dataclasses

    from streamrec.model.network import ModelSpec, table_configs
    from streamrec.pipelines.flink_runner import RunOptions
    from streamrec.pipelines.job import JobSpec
    from streamrec.serving.runtime.runner import RuntimeConfig

    DERIVED = {("TableConfig", "gpu_cache_rows"), ("TableConfig", "dram_rows")}  # rows from [ps]'s byte budgets
    cfg = load_config(environ={})
    built = [cfg.features, cfg.generator.world, ModelSpec.from_config(cfg.model, cfg.features),
             *table_configs(cfg.model, cfg.ps), RunOptions.from_config(cfg), JobSpec.from_config(cfg),
             RuntimeConfig.from_serving(cfg.serving)]
    disagree = []
    for settings in built:
        for f in dataclasses.fields(settings):
            if (type(settings).__name__, f.name) in DERIVED:
                continue
            if f.default is not dataclasses.MISSING and f.default != getattr(settings, f.name):
                disagree.append(f"{type(settings).__name__}.{f.name}: constructor {f.default!r}, defaults.toml {getattr(settings, f.name)!r}")
    assert disagree == []


def test_one_validation_place_names_every_bad_setting():
    with pytest.raises(ConfigError) as err:
        load_config(environ={}, overrides={"features.windows_s": "60,0", "model.history_len": 80, "serving.compile": "fast",
                                           "serving.batch_buckets": "1,x", "flink.delivery": "maybe",
                                           "flink.buffer_timeout_ms": 0})
    for expected in ("windows_s must be positive whole seconds", "model.history_len (80) must be within 1..features.history_len (50)",
                     "serving.compile must be one of", "serving.batch_buckets must be comma-separated", "flink.delivery must be",
                     "flink.buffer_timeout_ms must be >= 1"):
        assert expected in str(err.value)
    with pytest.raises(ConfigError, match="features.windows_s' must be a list of int"):
        load_config(environ={"STREAMREC_FEATURES__WINDOWS_S": "60,ten"})


def test_tier_budgets_are_sizes_in_bytes_split_across_the_tables(tmp_path):
    from streamrec.model.network import table_configs
    from streamrec.embedding.budget import array_bytes, tier_bytes
    from streamrec.embedding.table import EmbeddingTable

    cfg = load_config(environ={"STREAMREC_PS__HBM_BYTES": "512MiB"}, overrides={"ps.dram_bytes": "1.5GB"})
    assert cfg.ps.hbm_bytes == 512 * 2**20 and cfg.ps.dram_bytes == 1_500_000_000
    tables = table_configs(cfg.model, cfg.ps)
    dim = cfg.model.embedding_dim
    for t in tables:  # equal shares, as many rows as fit, the index included
        assert tier_bytes(t.gpu_cache_rows, dim, 1) <= 512 * 2**20 // len(tables) < tier_bytes(t.gpu_cache_rows + 1, dim, 1)
        assert tier_bytes(t.dram_rows, dim, 1) <= 1_500_000_000 // len(tables) < tier_bytes(t.dram_rows + 1, dim, 1)
    # what a table allocates for its DRAM budget fits the share: row arrays (as many rows as the
    # budget) plus the index it actually built; measured on the objects, not on the formula
    table = EmbeddingTable(tables[0], ssd_dir=tmp_path)
    dram = table.tiers.dram
    per_row = sum(t[0].numel() * t.element_size() for t in (dram.weights, dram.state, dram.last_seen, dram.keys, dram.live, dram.dirty))
    per_row += 8  # the GPU cache's pointer below (budgets are one formula for both tiers)
    assert per_row == array_bytes(dim, 1)
    index = sum(t.numel() * t.element_size() for t in dram.index.raw_tables())
    assert tables[0].dram_rows * per_row + index <= 1_500_000_000 // len(tables)
    table.close()
    assert load_config(environ={}, overrides={"ps.hbm_bytes": 2**30}).ps.hbm_bytes == 2**30  # a plain number
    for bad, message in (("4 gigs", "must be a size like"), ("-1GiB", "must be a size like"), ("", "must be a size like")):
        with pytest.raises(ConfigError, match=message):
            load_config(environ={}, overrides={"ps.hbm_bytes": bad})
    with pytest.raises(ValueError, match="fewer than 1024 rows"):
        table_configs(cfg.model, load_config(environ={}, overrides={"ps.dram_bytes": "64KiB"}).ps)


def test_row_budgets_name_their_replacement(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[model]\ngpu_cache_rows = 1000\n")
    with pytest.raises(ConfigError, match=r"model.gpu_cache_rows' is no longer read: set \[ps\] hbm_bytes"):
        load_config(path, environ={})


def test_a_bounded_job_has_no_idleness_unless_it_resumes():
    """`pipeline submit --bounded`: every partition ends, so none may go idle (a stalled
    reader's events would be lost); resumed from a checkpoint its partitions may not end,
    so the configured idleness applies. A sub-millisecond timeout still means idleness."""
    from streamrec.pipelines.job import JobSpec

    def idle(spec: JobSpec, restored: bool = False) -> str:
        return dict(line.split("=", 1) for line in spec.properties(restored).splitlines())["idle_timeout_ms"]

    cfg = load_config(environ={})
    configured = str(round(cfg.flink.idle_timeout_s * 1000))
    assert idle(JobSpec.from_config(cfg)) == configured != "0"
    assert idle(JobSpec.from_config(cfg, bounded=True)) == "0"
    assert idle(JobSpec.from_config(cfg, bounded=True), restored=True) == configured
    assert idle(JobSpec.from_config(load_config(overrides={"flink.idle_timeout_s": 0.0004}, environ={}))) == "1"


def test_serving_workers_auto_runs_batches_on_the_loop_on_cuda_and_on_a_thread_on_cpu():
    auto = load_config(environ={}).serving
    assert auto.workers == "auto" and auto.batch_workers("cuda") == 0 and auto.batch_workers("cpu") == 1
    two = load_config(environ={"STREAMREC_SERVING__WORKERS": "2"}).serving
    assert two.batch_workers("cuda") == two.batch_workers("cpu") == 2
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError, match="serving.workers must be 'auto' or a whole number"):
            load_config(environ={"STREAMREC_SERVING__WORKERS": bad})


def test_serving_candidate_counts_takes_auto_device_or_host_and_nothing_else():
    assert load_config(environ={}).serving.candidate_counts == "auto"
    assert load_config(environ={"STREAMREC_SERVING__CANDIDATE_COUNTS": "host"}).serving.candidate_counts == "host"
    with pytest.raises(ConfigError, match="serving.candidate_counts must be one of auto, device, host, got 'gpu'"):
        load_config(environ={"STREAMREC_SERVING__CANDIDATE_COUNTS": "gpu"})
