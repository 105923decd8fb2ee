package streamrec.flink;

import java.io.IOException;
import java.io.StringReader;
import java.time.Duration;
import java.util.Arrays;
import java.util.Properties;

import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.functions.KeySelector;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.connector.base.DeliveryGuarantee;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.connector.kafka.sink.KafkaSink;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.KafkaSourceBuilder;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.datastream.SingleOutputStreamOperator;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.kafka.clients.consumer.OffsetResetStrategy;
import org.apache.kafka.clients.producer.ProducerRecord;

/**
 * The streaming job: raw events in, labelled samples and rejected events out.
 *
 * <pre>
 * events topic -> parse + validate (source reader) -> route -+-> DLQ topic (rejected, late, orphan clicks)
 *                                                            |
 *   keyBy user:     UserStage     dedup, click join, user counters, click sequence
 *   keyBy item:     ItemStage     item counters
 *   keyBy category: CategoryStage category counters, the label join: label 1 at the first
 *                                 click, 0 when the attribution window closes -> samples topic
 * </pre>
 * Built from Python (pipelines/flink_runner.py) through PyFlink's gateway, so that the
 * CLI, the embedded mini-cluster and a remote cluster run the same graph. Settings arrive as
 * java.util.Properties text, written by pipelines/job.py (JobSpec.properties()).
 */
public final class SampleJob {
    private SampleJob() {}

    public static void build(StreamExecutionEnvironment env, String settings) throws IOException {
        Properties p = new Properties();
        p.load(new StringReader(settings));
        long[] windowsS = Arrays.stream(p.getProperty("windows_s").split(",")).mapToLong(Long::parseLong).toArray();
        long[] windowsMs = Arrays.stream(windowsS).map(w -> w * 1000).toArray();
        long attributionMs = Long.parseLong(p.getProperty("attribution_ms"));
        int stateCacheKeys = Integer.parseInt(p.getProperty("state_cache_keys"));
        int sourceParallelism = Integer.parseInt(p.getProperty("source_parallelism"));
        String bootstrap = p.getProperty("bootstrap");

        KafkaSourceBuilder<Event> source = KafkaSource.<Event>builder()
                .setBootstrapServers(bootstrap)
                .setTopics(p.getProperty("events_topic"))
                .setGroupId(p.getProperty("group_id"))
                // events of aborted or still-open producer transactions (a `generate --atomic`
                // backfill, a transactional upstream) are never read: the same as any event
                // from a plain producer otherwise
                .setProperty("isolation.level", "read_committed")
                .setStartingOffsets(OffsetsInitializer.committedOffsets(OffsetResetStrategy.EARLIEST))
                .setDeserializer(new EventDeserializer(new EventParser(p.getProperty("validation_spec"),
                        Long.parseLong(p.getProperty("max_future_skew_ms")))));
        if (Boolean.parseBoolean(p.getProperty("bounded"))) {
            source.setBounded(OffsetsInitializer.latest());
        }
        WatermarkStrategy<Event> watermarks = ValidEventWatermarks.strategy(
                Duration.ofMillis(Long.parseLong(p.getProperty("out_of_orderness_ms"))),
                Duration.ofMillis(Long.parseLong(p.getProperty("idle_timeout_ms"))));

        SingleOutputStreamOperator<Event> valid = env.fromSource(source.build(), watermarks, "events topic")
                .setParallelism(sourceParallelism).uid("events-source")
                .process(new RouteRejected()).returns(EventTypeInfoFactory.INFO)
                .setParallelism(sourceParallelism).name("route rejected events").uid("route");
        boolean featureState = Boolean.parseBoolean(p.getProperty("feature_state"));
        long bucketMs = Long.parseLong(p.getProperty("feature_bucket_ms"));
        int featurePartitions = Integer.parseInt(p.getProperty("features_partitions"));
        long maxWindowMs = Arrays.stream(windowsMs).max().orElseThrow();
        SingleOutputStreamOperator<Event> users = valid.keyBy(new ByUser(), Types.LONG)
                .transform("user: dedup, click join, counters, sequence", EventTypeInfoFactory.INFO,
                        withFeatures(new UserStage(windowsMs, attributionMs, Integer.parseInt(p.getProperty("history_len")), p.getProperty("orphan_reason"), p.getProperty("late_reason")).withStateCache(stateCacheKeys),
                                featureState, "user", bucketMs, featurePartitions, maxWindowMs))
                .uid("user-stage");
        SingleOutputStreamOperator<Event> items = users.keyBy(new ByItem(), Types.LONG)
                .transform("item counters", EventTypeInfoFactory.INFO,
                        withFeatures(new ItemStage(windowsMs).withStateCache(stateCacheKeys), featureState, "item", bucketMs, featurePartitions, maxWindowMs))
                .uid("item-stage");
        SingleOutputStreamOperator<Tuple2<byte[], byte[]>> samples = items.keyBy(new ByCategory(), Types.LONG)
                .transform("category: counters, label join", CategoryStage.OUTPUT,
                        withFeatures(new CategoryStage(windowsMs, attributionMs, new SampleJson(Integer.parseInt(p.getProperty("sample_version")), p.getProperty("sample_fields"), p.getProperty("counter_columns"), windowsS.length)).withStateCache(stateCacheKeys),
                                featureState, "category", bucketMs, featurePartitions, maxWindowMs))
                .uid("category-stage");
        if (featureState) {
            // one sink, the stages' parallelism: forward edges, so each stage subtask's records
            // reach each partition in the order it emitted them (its watermark records last)
            users.getSideOutput(FeatureState.TAG).union(items.getSideOutput(FeatureState.TAG), samples.getSideOutput(FeatureState.TAG))
                    .sinkTo(sink(p, "features", new FeatureState.Serializer(p.getProperty("features_topic"))))
                    .name("features topic").uid("features-sink");
        }

        String topic = p.getProperty("samples_topic");
        samples.sinkTo(sink(p, "samples", (KafkaRecordSerializationSchema<Tuple2<byte[], byte[]>>)
                (r, context, ts) -> new ProducerRecord<>(topic, r.f0, r.f1))).name("samples topic").uid("samples-sink");
        valid.getSideOutput(Dlq.TAG).union(users.getSideOutput(Dlq.TAG))
                .sinkTo(sink(p, "dlq", new Dlq.Serializer(p.getProperty("dlq_topic")))).name("DLQ topic").uid("dlq-sink");
    }

    private static <S, O> EventTimeStage<S, O> withFeatures(EventTimeStage<S, O> stage, boolean on, String entity, long bucketMs,
                                                           int partitions, long maxWindowMs) {
        return on ? stage.withFeatureState(new FeatureState(entity, bucketMs, partitions, maxWindowMs)) : stage;
    }

    private static <T> KafkaSink<T> sink(Properties p, String name, KafkaRecordSerializationSchema<T> serializer) {
        boolean exactlyOnce = Boolean.parseBoolean(p.getProperty("exactly_once"));
        return KafkaSink.<T>builder()
                .setBootstrapServers(p.getProperty("bootstrap"))
                .setRecordSerializer(serializer)
                .setDeliveryGuarantee(exactlyOnce ? DeliveryGuarantee.EXACTLY_ONCE : DeliveryGuarantee.AT_LEAST_ONCE)
                .setTransactionalIdPrefix(p.getProperty("transactional_prefix") + "-" + name)
                // brokers refuse transactions longer than transaction.max.timeout.ms (15 min by default)
                .setProperty("transaction.timeout.ms", "900000")
                // fewer, larger produce requests: less CPU in the job's producer and in the broker
                .setProperty("linger.ms", "20")
                .setProperty("batch.size", "262144")
                .build();
    }

    static final class ByUser implements KeySelector<Event, Long> {
        @Override public Long getKey(Event e) { return e.userId; }
    }

    static final class ByItem implements KeySelector<Event, Long> {
        @Override public Long getKey(Event e) { return e.itemId; }
    }

    static final class ByCategory implements KeySelector<Event, Long> {
        @Override public Long getKey(Event e) { return e.categoryId; }
    }

}
