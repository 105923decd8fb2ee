package streamrec.flink;

import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Map;

import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.common.typeutils.base.StringSerializer;
import org.apache.flink.api.common.typeutils.base.array.BytePrimitiveArraySerializer;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.runtime.state.StateSnapshotContext;
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
 * <p>With the state cache on ({@link #withStateCache}), a sample waits in memory until the
 * next checkpoint (or until that many wait) and only then goes to the backend: most samples
 * of a backlog, and the clicked ones of a live stream, are labelled before that and never
 * touch RocksDB, which otherwise costs a put, a get and a delete per impression.
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
    private transient Map<String, Waiting> recent; // samples not yet written to `unlabelled` (since the last checkpoint)

    /** A sample waiting in memory, with the key it belongs to in the backend. */
    private static final class Waiting {
        final long categoryId;
        final byte[] sample;

        Waiting(long categoryId, byte[] sample) {
            this.categoryId = categoryId;
            this.sample = sample;
        }
    }

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
        recent = stateCacheKeys() > 0 ? new HashMap<>() : null;
    }

    @Override
    public void snapshotState(StateSnapshotContext context) throws Exception {
        spill(); // the checkpoint must hold every waiting sample
        super.snapshotState(context);
    }

    /** Move the samples waiting in memory to the backend. */
    private void spill() throws Exception {
        if (recent == null || recent.isEmpty()) {
            return;
        }
        for (Map.Entry<String, Waiting> w : recent.entrySet()) {
            setCurrentKey(w.getValue().categoryId);
            unlabelled.put(w.getKey(), w.getValue().sample);
        }
        recent.clear();
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
            byte[] sample = encoder.unlabelled(e, counter.counts(e.ts, windowsMs));
            if (recent == null) {
                unlabelled.put(e.eventId, sample);
            } else {
                recent.put(e.eventId, new Waiting(e.categoryId, sample));
                if (recent.size() > stateCacheKeys()) {
                    spill();
                    setCurrentKey(e.categoryId);
                }
            }
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
        Waiting waiting = recent == null ? null : recent.remove(impression);
        byte[] sample = waiting != null ? waiting.sample : unlabelled.get(impression);
        if (sample == null) {
            return; // its first click already labelled it (a deadline), or cannot happen (a click)
        }
        if (waiting == null) {
            unlabelled.remove(impression);
        }
        byte[] value = Arrays.copyOf(sample, sample.length + label.length);
        System.arraycopy(label, 0, value, sample.length, label.length);
        emit(Tuple2.of(SampleJson.key(e.userId), value), e.ts);
    }
}
