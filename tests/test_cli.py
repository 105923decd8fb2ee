"""Every command's --help is useful; `config` shows the effective settings."""

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), ["kafka", "generate", "pipeline", "setup", "demo", "bench", "STREAMREC_KAFKA__BOOTSTRAP"]),
        (("pipeline", "offline"), ["--attribution-window-s", "--history-len", "samples.parquet"]),
        (("kafka",), ["up", "down", "status"]),
        (("kafka", "up"), ["--partitions", "--port", "--bootstrap", "--config"]),
        (("kafka", "status"), ["--json"]),
        (("setup", "flink-job"), ["--jars-dir", "--verify", "Maven"]),
        (("kafka", "up"), ["--brokers", "--data-dir"]),
        (("generate",), ["--rate", "--duration", "--bad-fraction", "--seed", "--out", "--format", "generator.rate: 2000"]),
        (("demo",), ["--duration", "--keep-broker"]),
        (("bench",), ["generator", "ps"]),
    ],
)
def test_help(args, expected):
    result = run_cli(*args, "--help")
    assert result.returncode == 0, result.stderr
    for word in expected:
        assert word in result.stdout, (args, word)


def test_config_shows_flags_and_environment():
    result = run_cli("--bootstrap", "k1:9092,k2:9092", "config", env={"STREAMREC_KAFKA__PARTITIONS": "12"})
    assert result.returncode == 0, result.stderr
    cfg = json.loads(result.stdout)
    assert cfg["kafka"]["bootstrap"] == "k1:9092,k2:9092" and cfg["kafka"]["partitions"] == 12
    assert cfg["source"] == "defaults < environment < flags"


def test_unknown_command_is_a_usage_error():
    result = run_cli("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_bad_flag_values_get_clear_errors(tmp_path):
    result = run_cli("generate", "--out", str(tmp_path / "x"), "--duration", "-1")
    assert result.returncode == 2 and "--duration must be > 0" in result.stderr
    result = run_cli("generate", "--out", str(tmp_path / "y"), "--rate", "0", "--duration", "1")
    assert result.returncode == 2 and "rate must be > 0" in result.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    result = run_cli("train", "--nproc-per-node", "0", "--samples", str(tmp_path / "none"))
    assert result.returncode == 2 and "--nproc-per-node must be >= 1, got 0" in result.stderr
    result = run_cli("pipeline", "offline", str(tmp_path / "none"), "--row-group-rows", "0")
    assert result.returncode == 2 and "--row-group-rows must be >= 1, got 0" in result.stderr
