"""A PyFlink execution environment with the Kafka connector on its classpath.

The embedded mini-cluster starts inside the PyFlink gateway JVM on first use (~5-10 s);
the Flink job (pipelines/) and the connector tests both start from here.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.flink_jars import jar_urls, verify_jars


def stream_env(jars_dir: Path, parallelism: int = 1):
    """A StreamExecutionEnvironment with the verified connector jars added."""
    from pyflink.datastream import StreamExecutionEnvironment

    verify_jars(jars_dir)  # a clear error here beats a ClassNotFoundException later
    env = StreamExecutionEnvironment.get_execution_environment()
    env.add_jars(*jar_urls(jars_dir))
    env.set_parallelism(parallelism)
    return env


def kafka_string_source(bootstrap: str, topic: str, group_id: str, bounded: bool = False):
    """A KafkaSource of UTF-8 values from the earliest offset (up to the current end if ``bounded``)."""
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream.connectors.kafka import KafkaOffsetsInitializer, KafkaSource

    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(bootstrap)
        .set_topics(topic)
        .set_group_id(group_id)
        .set_starting_offsets(KafkaOffsetsInitializer.earliest())
        .set_value_only_deserializer(SimpleStringSchema())
    )
    if bounded:
        builder = builder.set_bounded(KafkaOffsetsInitializer.latest())
    return builder.build()
