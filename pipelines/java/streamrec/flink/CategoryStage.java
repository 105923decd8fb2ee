package streamrec.flink;

import java.nio.charset.StandardCharsets;
import java.util.Arrays;

import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.common.typeutils.base.StringSerializer;
import org.apache.flink.api.common.typeutils.base.array.BytePrimitiveArraySerializer;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;

/**
 * Category counters (keyed by category_id; a click counts for its impression's category),
 * then the label join, here because an impression and its clicks share the category key:
 * the impression's sample, now complete but for the label, waits in state (RocksDB: an
 * attribution window of minutes holds millions) until its first joined click arrives (label
 * 1 at once) or the watermark passes ts + the attribution window (label 0). The deadline is
 * an event this stage schedules for itself. Exactly one sample per impression: the user
 * stage dropped duplicates and marked only the first click of each impression.
 *
 * <p>Output: (Kafka key = user id, sample JSON).
 */
public final class CategoryStage extends CounterStage<Tuple2<byte[], byte[]>> {
    private static final long serialVersionUID = 1L;
    public static final TypeInformation<Tuple2<byte[], byte[]>> OUTPUT =
            Types.TUPLE(Types.PRIMITIVE_ARRAY(Types.BYTE), Types.PRIMITIVE_ARRAY(Types.BYTE));
    private static final byte[] NEGATIVE = ",\"label\":0,\"click_ts\":null}".getBytes(StandardCharsets.US_ASCII);

    private final long attributionMs;
    private final SampleJson encoder;
    private transient MapState<String, byte[]> unlabelled; // impression event id -> sample without its label

    public CategoryStage(long[] windowsMs, long attributionMs, SampleJson encoder) {
        super(windowsMs);
        this.attributionMs = attributionMs;
        this.encoder = encoder;
    }

    @Override
    public void open() throws Exception {
        super.open();
        unlabelled = getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE,
                new MapStateDescriptor<>("unlabelled", StringSerializer.INSTANCE, BytePrimitiveArraySerializer.INSTANCE));
    }

    @Override
    protected long keyOf(Event e) {
        return e.categoryId;
    }

    @Override
    protected void apply(WindowCounter counter, Event e) throws Exception {
        if (e.kind == Event.LABEL_DEADLINE) {
            label(e, NEGATIVE);
            return;
        }
        if (e.kind == Event.IMPRESSION) {
            unlabelled.put(e.eventId, encoder.unlabelled(e, counter.counts(e.ts, windowsMs)));
            Event deadline = new Event();
            deadline.kind = Event.LABEL_DEADLINE;
            deadline.ts = e.ts + attributionMs; // a click at this very ms still joins: clicks sort first
            deadline.eventId = e.eventId;
            deadline.requestId = "";
            deadline.userId = e.userId;
            deadline.categoryId = e.categoryId;
            schedule(deadline);
        } else if (e.firstClick) {
            label(e, ("," + "\"label\":1,\"click_ts\":" + e.ts + "}").getBytes(StandardCharsets.US_ASCII));
        }
        counter.add(e.kind, e.ts, maxWindowMs);
    }

    /** Emit the waiting sample of the impression {@code e} refers to with {@code label}, once. */
    private void label(Event e, byte[] label) throws Exception {
        String impression = e.kind == Event.CLICK ? e.impressionId : e.eventId;
        byte[] sample = unlabelled.get(impression);
        if (sample == null) {
            return; // its first click already labelled it (a deadline), or cannot happen (a click)
        }
        unlabelled.remove(impression);
        byte[] value = Arrays.copyOf(sample, sample.length + label.length);
        System.arraycopy(label, 0, value, sample.length, label.length);
        emit(Tuple2.of(SampleJson.key(e.userId), value), e.ts);
    }
}
