package streamrec.flink;

import java.io.Serializable;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;

import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.util.OutputTag;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.utils.Utils;

/**
 * The records of the features topic (format: pipelines/feature_state.py, docs/features.md):
 * a stage's per-entity state after each watermark, for serving's online feature store.
 *
 * <ul>
 *   <li>{@code c/<entity>/<id>/<bucket start>} -> {@code {"i":[offsets],"c":[offsets]}}: the
 *       entity's counted event times in one bucket (ms offsets from its start); null value:
 *       the bucket's times all left the largest window.</li>
 *   <li>{@code h/user/<id>} -> {@code {"h":[[item,category,ts],...]}}: the click sequence.</li>
 *   <li>{@code w/<stage>/<subtask>/<partition>} -> {@code {"wm":W,"n":P}}: one per partition,
 *       after the stage subtask's records of every event at or before W.</li>
 * </ul>
 * An entity's records go to partition murmur2("entity/id") (Kafka's default partitioner's
 * hash), so they share one.
 */
public final class FeatureState implements Serializable {
    private static final long serialVersionUID = 1L;
    static final byte[] TOMBSTONE = new byte[0];
    /** (partition, key, value; an empty value is a tombstone). */
    public static final TypeInformation<Tuple3<Integer, byte[], byte[]>> TYPE =
            Types.TUPLE(Types.INT, Types.PRIMITIVE_ARRAY(Types.BYTE), Types.PRIMITIVE_ARRAY(Types.BYTE));
    public static final OutputTag<Tuple3<Integer, byte[], byte[]>> TAG = new OutputTag<>("features", TYPE);

    final String entity;
    final long bucketMs;
    final int partitions;
    final long maxWindowMs;

    public FeatureState(String entity, long bucketMs, int partitions, long maxWindowMs) {
        this.entity = entity;
        this.bucketMs = bucketMs;
        this.partitions = partitions;
        this.maxWindowMs = maxWindowMs;
    }

    int partitionOf(long id) {
        return (Utils.murmur2((entity + "/" + id).getBytes(StandardCharsets.UTF_8)) & 0x7fffffff) % partitions;
    }

    long bucketOf(long ts) {
        return Math.floorDiv(ts, bucketMs) * bucketMs;
    }

    /** The content of bucket {@code start} of {@code counter}, or null when it holds no time. */
    Tuple3<Integer, byte[], byte[]> bucket(long id, WindowCounter counter, long start) {
        StringBuilder json = new StringBuilder(64).append("{\"i\":[");
        int n = appendOffsets(json, counter.imps, start);
        json.append("],\"c\":[");
        n += appendOffsets(json, counter.clicks, start);
        if (n == 0) {
            return null;
        }
        json.append("]}");
        return Tuple3.of(partitionOf(id), key("c/" + entity + "/" + id + "/" + start), json.toString().getBytes(StandardCharsets.US_ASCII));
    }

    Tuple3<Integer, byte[], byte[]> tombstone(long id, long start) {
        return Tuple3.of(partitionOf(id), key("c/" + entity + "/" + id + "/" + start), TOMBSTONE);
    }

    Tuple3<Integer, byte[], byte[]> history(long userId, long[] items, long[] categories, long[] times) {
        StringBuilder json = new StringBuilder(16 + 40 * items.length).append("{\"h\":[");
        for (int i = 0; i < items.length; i++) {
            if (i > 0) json.append(',');
            json.append('[').append(items[i]).append(',').append(categories[i]).append(',').append(times[i]).append(']');
        }
        json.append("]}");
        return Tuple3.of(partitionOf(userId), key("h/user/" + userId), json.toString().getBytes(StandardCharsets.US_ASCII));
    }

    Tuple3<Integer, byte[], byte[]> watermark(int subtask, int parallelism, int partition, long watermark) {
        byte[] value = ("{\"wm\":" + watermark + ",\"n\":" + parallelism + "}").getBytes(StandardCharsets.US_ASCII);
        return Tuple3.of(partition, key("w/" + entity + "/" + subtask + "/" + partition), value);
    }

    /** Distinct buckets of the times at or before {@code cutoff} (those the next adds expire). */
    long[] bucketsUpTo(WindowCounter counter, long cutoff) {
        long[] out = new long[4];
        int n = 0;
        for (TimeRing ring : new TimeRing[] {counter.imps, counter.clicks}) {
            for (int i = ring.start; i < ring.end && ring.times[i] <= cutoff; i++) {
                long b = bucketOf(ring.times[i]);
                if (n == 0 || out[n - 1] != b) {
                    if (n == out.length) out = Arrays.copyOf(out, n * 2);
                    out[n++] = b;
                }
            }
        }
        return Arrays.copyOf(out, n);
    }

    /** Whether {@code counter} still holds a time in bucket {@code start}. */
    boolean holds(WindowCounter counter, long start) {
        return counter.imps.countBetween(start - 1, start + bucketMs) + counter.clicks.countBetween(start - 1, start + bucketMs) > 0;
    }

    private int appendOffsets(StringBuilder json, TimeRing ring, long start) {
        int from = ring.lowerBound(start), to = ring.lowerBound(start + bucketMs);
        for (int i = from; i < to; i++) {
            if (i > from) json.append(',');
            json.append(ring.times[i] - start);
        }
        return to - from;
    }

    private static byte[] key(String key) {
        return key.getBytes(StandardCharsets.US_ASCII);
    }

    /** To the features topic: the record's partition, key and value (an empty value: null, a tombstone). */
    public static final class Serializer implements KafkaRecordSerializationSchema<Tuple3<Integer, byte[], byte[]>> {
        private static final long serialVersionUID = 1L;
        private final String topic;

        public Serializer(String topic) {
            this.topic = topic;
        }

        @Override
        public ProducerRecord<byte[], byte[]> serialize(Tuple3<Integer, byte[], byte[]> r, KafkaSinkContext context, Long timestamp) {
            return new ProducerRecord<>(topic, r.f0, r.f1, r.f2.length == 0 ? null : r.f2);
        }
    }
}
