package streamrec.flink;

import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.Iterator;
import java.util.LinkedHashMap;

import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.common.typeutils.base.StringSerializer;
import org.apache.flink.api.common.typeutils.base.array.BytePrimitiveArraySerializer;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.runtime.state.StateInitializationContext;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;

/**
 * Category counters (keyed by category_id; a click counts for its impression's category),
 * then the label join, here because an impression and its clicks share the category key:
 * the impression's sample, now complete but for the label, waits until its first joined
 * click arrives (label 1 at once: the user stage's early label, or the click itself in event
 * time) or the watermark passes ts + the attribution window (label 0). The deadline is an
 * event this stage schedules for itself. Exactly one sample per impression: the user stage
 * dropped duplicates and marked only the first click of each impression, and a sample leaves
 * the stage once whichever label reaches it first.
 *
 * <p>Where a sample waits: on its deadline event, in memory (so it is in every checkpoint
 * with the stage's event buffer, as raw keyed state), up to {@code stateCacheKeys} samples;
 * beyond that the oldest move to the backend (a MapState: an attribution window of minutes
 * holds millions). Most samples are labelled before that and never touch RocksDB, which
 * costs a put, a get and a delete per sample, and a share of its flushes and compactions.
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
    private transient LinkedHashMap<String, Event> waiting; // impression event id -> its deadline, carrying the sample

    public CategoryStage(long[] windowsMs, long attributionMs, SampleJson encoder) {
        super(windowsMs);
        this.attributionMs = attributionMs;
        this.encoder = encoder;
    }

    @Override
    public void initializeState(StateInitializationContext context) throws Exception {
        waiting = new LinkedHashMap<>(); // before the restore: restored() fills it
        super.initializeState(context);
    }

    @Override
    protected void restored(Event e) {
        if (e.kind == Event.LABEL_DEADLINE && e.sample != null) {
            waiting.put(e.eventId, e);
        }
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

    /** A click's label, sent by the user stage when the click arrived: label the waiting
     *  sample now rather than when the watermark reaches the click. If the sample is not here
     *  yet (its impression is still on its way) the click labels it in event time, as ever. */
    @Override
    protected void early(Event e) throws Exception {
        label(e, e.impressionId, positive(e.ts));
    }

    private static byte[] positive(long clickTs) {
        return (",\"label\":1,\"click_ts\":" + clickTs + "}").getBytes(StandardCharsets.US_ASCII);
    }

    @Override
    protected void apply(WindowCounter counter, Event e) throws Exception {
        if (e.kind == Event.LABEL_DEADLINE) {
            label(e, e.eventId, NEGATIVE);
            return;
        }
        if (e.kind == Event.IMPRESSION) {
            Event deadline = new Event();
            deadline.kind = Event.LABEL_DEADLINE;
            deadline.ts = e.ts + attributionMs; // a click at this very ms still joins: clicks sort first
            deadline.eventId = e.eventId;
            deadline.requestId = "";
            deadline.userId = e.userId;
            deadline.categoryId = e.categoryId;
            deadline.sample = encoder.unlabelled(e, counter.counts(e.ts, windowsMs));
            schedule(deadline);
            waiting.put(e.eventId, deadline);
            if (waiting.size() > stateCacheKeys()) {
                spillOldest(e.categoryId);
            }
        } else if (e.firstClick) {
            label(e, e.impressionId, positive(e.ts));
        }
        counter.add(e.kind, e.ts, maxWindowMs);
    }

    /** Move the longest-waiting sample in memory to the backend ({@code currentKey}: the key being applied). */
    private void spillOldest(long currentKey) throws Exception {
        Iterator<Event> oldest = waiting.values().iterator();
        Event deadline = oldest.next();
        oldest.remove();
        if (deadline.categoryId != currentKey) setCurrentKey(deadline.categoryId);
        unlabelled.put(deadline.eventId, deadline.sample);
        deadline.sample = null; // when it fires, the deadline finds the sample in the backend
        if (deadline.categoryId != currentKey) setCurrentKey(currentKey);
    }

    /** Emit the waiting sample of {@code impression} with {@code label}, once ({@code e}: the click or the deadline). */
    private void label(Event e, String impression, byte[] label) throws Exception {
        Event deadline = waiting.remove(impression);
        byte[] sample = null;
        if (deadline != null) {
            sample = deadline.sample;
            deadline.sample = null; // labelled: the deadline, when it fires, finds nothing
        } else {
            sample = unlabelled.get(impression); // spilled, or already labelled (then null)
            if (sample != null) {
                unlabelled.remove(impression);
            }
        }
        if (sample == null) {
            return;
        }
        byte[] value = Arrays.copyOf(sample, sample.length + label.length);
        System.arraycopy(label, 0, value, sample.length, label.length);
        emit(Tuple2.of(SampleJson.key(e.userId), value), e.ts);
    }
}
