"""The Flink job as SQL: raw events in, labelled samples and rejected events out.

Graph (docs/pipeline.md has the picture and the state sizes):

    events topic --> checked (validate: reason CASE, late check) --+--> DLQ topic (reason header)
                                                                    |
                     valid events --> OVER user_id: UserFeatures ---+--> orphan clicks --> DLQ
                                        |                   |
                                        | imps + joined     +--> label clicks (first per impression)
                                        v clicks                          |
                     OVER item_id: WindowCounts                           |
                     OVER category_id: WindowCounts --> features (imps) --+--> interval LEFT JOIN
                                                                                 --> samples topic

Everything runs in the JVM: SQL for parsing, validation, routing and the label join, two
small Java aggregate functions (pipelines/udf/) for the per-user and per-entity state that
SQL cannot express exactly (strictly-before counts, the click sequence, dedup, the click
join without the interval join's watermark delay).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines import events as ev
from pipelines.samples import SAMPLE_VERSION, SampleSpec
from pipelines.validation_sql import parse_call

LATE_EVENT = "late_event"  # reason code of valid events behind the watermark (docs/pipeline.md)
# epoch ms of the Kafka record timestamp (the job runs with the UTC session time zone)
ARRIVAL_MS = "(EXTRACT(EPOCH FROM arrival) * 1000 + EXTRACT(MILLISECOND FROM arrival))"


@dataclass(frozen=True)
class JobSpec:
    bootstrap: str
    events_topic: str
    samples_topic: str
    dlq_topic: str
    group_id: str
    sample_spec: SampleSpec = SampleSpec()
    out_of_orderness_ms: int = 1000
    idle_timeout_ms: int = 5000
    exactly_once: bool = True
    transactional_prefix: str = "streamrec-pipeline"
    bounded: bool = False  # stop at the topic's current end (tests, backfills)
    # One source reader per partition: a reader's watermark only covers the partitions it
    # has started reading, so a reader with several partitions of backlog would run its
    # watermark ahead of the partitions it has not reached yet and drop them as late.
    source_parallelism: int = 1


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _kafka_options(spec: JobSpec, topic: str, sink: bool, prefix: str = "") -> str:
    opts = {"connector": "kafka", "topic": topic, "properties.bootstrap.servers": spec.bootstrap}
    if sink:
        if spec.exactly_once:
            opts.update({
                "sink.delivery-guarantee": "exactly-once",
                "sink.transactional-id-prefix": f"{spec.transactional_prefix}-{prefix}",
                # brokers refuse transactions longer than transaction.max.timeout.ms (15 min by default)
                "properties.transaction.timeout.ms": "900000",
            })
        else:
            opts["sink.delivery-guarantee"] = "at-least-once"
    else:
        opts.update({"scan.parallelism": str(spec.source_parallelism), "properties.group.id": spec.group_id, "scan.startup.mode": "group-offsets",
                     "properties.auto.offset.reset": "earliest",
                     "scan.watermark.idle-timeout": f"{spec.idle_timeout_ms} ms"})
        if spec.bounded:
            opts["scan.bounded.mode"] = "latest-offset"
    return ",\n  ".join(f"{_q(k)} = {_q(v)}" for k, v in opts.items())


def ddl(spec: JobSpec) -> list[str]:
    """The three Kafka tables."""
    skew = ev.MAX_FUTURE_SKEW_MS
    ts = "TRY_CAST(JSON_VALUE(CAST(payload AS STRING), '$.ts') AS BIGINT)"
    source = f"""CREATE TEMPORARY TABLE raw_events (
  k BYTES,
  payload BYTES,
  arrival TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  arrival_ms AS {ARRIVAL_MS},
  -- event time; an event whose ts is unusable is placed at its arrival time so that it
  -- can never move the watermark (it is rejected on the way anyway)
  rowtime AS CASE WHEN {ts} IS NULL OR {ts} <= 0 OR {ts} > {ARRIVAL_MS} + {skew}
                  THEN arrival ELSE TO_TIMESTAMP_LTZ({ts}, 3) END,
  WATERMARK FOR rowtime AS rowtime - INTERVAL '{spec.out_of_orderness_ms / 1000:.3f}' SECOND
) WITH (
  {_kafka_options(spec, spec.events_topic, sink=False)},
  'key.format' = 'raw', 'key.fields' = 'k', 'value.format' = 'raw', 'value.fields-include' = 'EXCEPT_KEY'
)"""
    dlq = f"""CREATE TEMPORARY TABLE dlq (
  k BYTES,
  payload BYTES,
  headers MAP<STRING, BYTES> METADATA
) WITH (
  {_kafka_options(spec, spec.dlq_topic, sink=True, prefix="dlq")},
  'key.format' = 'raw', 'key.fields' = 'k', 'value.format' = 'raw', 'value.fields-include' = 'EXCEPT_KEY'
)"""
    s = spec.sample_spec
    counters = ",\n  ".join(f"{name} INT" for name in s.counter_columns())
    samples = f"""CREATE TEMPORARY TABLE samples (
  k STRING,
  sample_version SMALLINT, event_id STRING, request_id STRING, ts BIGINT, user_id BIGINT, item_id BIGINT,
  `position` INT, device STRING, local_hour INT, category_id BIGINT, advertiser_id BIGINT,
  hist_item_ids ARRAY<BIGINT>, hist_category_ids ARRAY<BIGINT>,
  {counters},
  label TINYINT, click_ts BIGINT
) WITH (
  {_kafka_options(spec, spec.samples_topic, sink=True, prefix="samples")},
  'key.format' = 'raw', 'key.fields' = 'k', 'value.format' = 'json', 'value.fields-include' = 'EXCEPT_KEY',
  'value.json.encode.ignore-null-fields' = 'false'
)"""
    return [source, dlq, samples]


def functions(jar_class_prefix: str = "streamrec.flink") -> list[str]:
    return [f"CREATE TEMPORARY SYSTEM FUNCTION {name} AS '{jar_class_prefix}.{name}' LANGUAGE JAVA"
            for name in ("ParseEvent", "UserFeatures", "WindowCounts")]


def views(spec: JobSpec) -> list[str]:
    s = spec.sample_spec
    windows = ",".join(str(int(w * 1000)) for w in s.windows_s)
    attribution_ms = int(s.attribution_window_s * 1000)
    over = "ORDER BY rowtime ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW"
    return [
        f"""CREATE TEMPORARY VIEW parsed AS
SELECT k, payload, rowtime, {parse_call()} AS e FROM raw_events""",
        f"""CREATE TEMPORARY VIEW checked AS
SELECT k, payload, rowtime, e,
  CASE WHEN e.reason IS NOT NULL THEN e.reason
       WHEN rowtime <= CURRENT_WATERMARK(rowtime) THEN '{LATE_EVENT}'
       ELSE CAST(NULL AS STRING) END AS reason
FROM parsed""",
        """CREATE TEMPORARY VIEW valid_events AS
SELECT k, rowtime, e.ts AS ts, e.kind AS kind, e.event_id AS event_id, e.request_id AS request_id,
  e.user_id AS user_id, e.item_id AS item_id, e.`position` AS `position`, e.device AS device,
  e.local_hour AS local_hour, e.category_id AS category_id, e.advertiser_id AS advertiser_id,
  CASE WHEN e.kind = 1 THEN payload END AS click_payload
FROM checked WHERE reason IS NULL""",
        f"""CREATE TEMPORARY VIEW user_stage AS
SELECT *, UserFeatures(ts, kind, event_id, request_id, item_id, category_id, '{windows}',
                       CAST({attribution_ms} AS BIGINT), {s.history_len})
          OVER (PARTITION BY user_id {over}) AS u
FROM valid_events""",
        f"""CREATE TEMPORARY VIEW entity_stage AS
SELECT *, WindowCounts(ts, kind, '{windows}') OVER (PARTITION BY cat {over}) AS cc
FROM (
  SELECT *, WindowCounts(ts, kind, '{windows}') OVER (PARTITION BY item_id {over}) AS ic
  FROM (SELECT rowtime, ts, kind, event_id, request_id, user_id, item_id, `position`, device, local_hour,
               u.category_id AS cat, advertiser_id, u.counts AS uc, u.hist_item_ids, u.hist_category_ids
        FROM user_stage WHERE NOT u.dup AND (kind = 0 OR u.joined)))""",
        """CREATE TEMPORARY VIEW features AS SELECT * FROM entity_stage WHERE kind = 0""",
        """CREATE TEMPORARY VIEW label_clicks AS
SELECT rowtime, ts, user_id, request_id, item_id FROM user_stage WHERE kind = 1 AND u.first_click""",
    ]


def inserts(spec: JobSpec) -> list[str]:
    s = spec.sample_spec
    attribution_ms = int(s.attribution_window_s * 1000)
    counter_exprs = []
    for i, _w in enumerate(s.windows_s):
        for entity, col in (("user", "uc"), ("item", "ic"), ("category", "cc")):
            for j, what in enumerate(("imps", "clicks")):
                counter_exprs.append((f"{entity}_{what}_{_w}s", f"f.{col}[{2 * i + j + 1}]"))
    by_name = dict(counter_exprs)
    counters = ", ".join(f"{by_name[name]} AS {name}" for name in s.counter_columns())
    orphan = f"{ev.ORPHAN_CLICK}: no impression of its (request_id, item_id) within the attribution window"
    return [
        f"""INSERT INTO samples
SELECT CAST(f.user_id AS STRING), CAST({SAMPLE_VERSION} AS SMALLINT), f.event_id, f.request_id, f.ts, f.user_id, f.item_id,
  f.`position`, f.device, f.local_hour, f.cat, f.advertiser_id, f.hist_item_ids, f.hist_category_ids,
  {counters},
  CAST(CASE WHEN c.ts IS NULL THEN 0 ELSE 1 END AS TINYINT), c.ts
FROM features f LEFT JOIN label_clicks c
  ON f.user_id = c.user_id AND f.request_id = c.request_id AND f.item_id = c.item_id
  AND c.rowtime BETWEEN f.rowtime AND f.rowtime + INTERVAL '{attribution_ms / 1000:.3f}' SECOND""",
        """INSERT INTO dlq
SELECT k, payload, MAP['reason', CAST(reason AS BYTES)] FROM checked WHERE reason IS NOT NULL""",
        f"""INSERT INTO dlq
SELECT k, click_payload, MAP['reason', CAST({_q(orphan)} AS BYTES)]
FROM user_stage WHERE kind = 1 AND NOT u.dup AND NOT u.joined""",
    ]


def statements(spec: JobSpec) -> tuple[list[str], list[str]]:
    """(set-up statements to execute one by one, INSERTs to run as one statement set)."""
    spec.sample_spec.validate()
    return ddl(spec) + functions() + views(spec), inserts(spec)
