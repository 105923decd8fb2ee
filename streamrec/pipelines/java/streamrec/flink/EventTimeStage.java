package streamrec.flink;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.SortedMap;
import java.util.TreeMap;

import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.runtime.state.StateInitializationContext;
import org.apache.flink.runtime.state.StateSnapshotContext;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;
import org.apache.flink.streaming.api.operators.AbstractStreamOperator;
import org.apache.flink.streaming.api.operators.OneInputStreamOperator;
import org.apache.flink.streaming.api.watermark.Watermark;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;

/**
 * A keyed stage that sees each key's events in event-time order, one state read and one
 * state write per key and watermark instead of per event.
 *
 * <p>Why not a KeyedProcessFunction with a timer per event (what Flink SQL's OVER window
 * does): that costs a state write to buffer each event and a read, a write and a timer to
 * process it. Here events wait in an in-memory buffer (by time) until the watermark passes
 * them (at most the out-of-orderness worth of input), then the ready ones are sorted by
 * (key, time) and each key's run is applied to its state (RocksDB or heap) in one go. The buffer
 * is checkpointed as raw keyed state ({@link KeyGroupSnapshot}). With RocksDB, recently used
 * key states stay in memory between watermarks ({@link StateCache}, {@link #withStateCache}).
 *
 * <p>The output order is by key, then time: the next stage sorts again.
 */
public abstract class EventTimeStage<S, OUT> extends AbstractStreamOperator<OUT> implements OneInputStreamOperator<Event, OUT> {
    private static final long serialVersionUID = 1L;
    private static final EventSerializer EVENTS = new EventSerializer();

    private static final int BUCKET_BITS = 6; // the buffer's time buckets: 64 ms
    private transient TreeMap<Long, List<Event>> buffer; // by event time, in buckets
    private transient HashMap<Long, List<Event>> runs; // a drain's ready events by key (reused)
    private transient long watermark = Long.MIN_VALUE;
    private transient ValueState<S> state;
    private transient StreamRecord<OUT> outRecord;
    private int stateCacheKeys; // 0: every key's state is read and written on each watermark
    private transient StateCache<S> cache;
    private FeatureState features; // null: the stage publishes no feature state
    private transient StreamRecord<Tuple3<Integer, byte[], byte[]>> featureRecord;
    private transient long publishedWatermark = Long.MIN_VALUE;

    /** Publish each changed key's feature state after every watermark (FeatureState). */
    public final EventTimeStage<S, OUT> withFeatureState(FeatureState features) {
        this.features = features;
        return this;
    }

    /** The key's counter in {@code state} (the feature state's event times). */
    protected abstract WindowCounter counterOf(S state);

    /** More feature records of a key after its run (the user stage: its click sequence). */
    protected void publishMore(long key, S state, List<Event> run) {}

    protected final FeatureState features() {
        return features;
    }

    protected final void emitFeature(Tuple3<Integer, byte[], byte[]> record) {
        output.collect(FeatureState.TAG, featureRecord.replace(record, watermark));
    }

    /** Keep up to {@code keys} key states in memory, written back on eviction and at checkpoints
     *  (RocksDB only: see {@link StateCache}). */
    public final EventTimeStage<S, OUT> withStateCache(int keys) {
        this.stateCacheKeys = keys;
        return this;
    }

    protected final int stateCacheKeys() {
        return stateCacheKeys;
    }

    /** The key this stage partitions by (the same as the keyBy in front of it). */
    protected abstract long keyOf(Event e);

    protected abstract TypeSerializer<S> stateSerializer();

    protected abstract S newState();

    /** Apply one event to its key's state; emit whatever follows with {@link #emit}. */
    protected abstract void apply(S state, Event e) throws Exception;

    protected final void emit(OUT value, long timestamp) {
        output.collect(outRecord.replace(value, timestamp));
    }

    @Override
    protected boolean isUsingCustomRawKeyedState() {
        return true;
    }

    @Override
    public void initializeState(StateInitializationContext context) throws Exception {
        super.initializeState(context);
        buffer = new TreeMap<>();
        runs = new HashMap<>();
        KeyGroupSnapshot.read(context, in -> {
            Event e = EVENTS.deserialize(in);
            schedule(e);
            restored(e);
        });
    }

    /** Called for each buffered event a restore brings back (after it is scheduled again). */
    protected void restored(Event e) {}

    @Override
    public void open() throws Exception {
        super.open();
        state = getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE,
                new ValueStateDescriptor<>("state", stateSerializer()));
        outRecord = new StreamRecord<>(null);
        featureRecord = new StreamRecord<>(null);
        if (stateCacheKeys > 0) {
            cache = new StateCache<>(stateCacheKeys);
            getRuntimeContext().getMetricGroup().gauge("stateCacheHits", () -> cache.hits());
            getRuntimeContext().getMetricGroup().gauge("stateCacheMisses", () -> cache.misses());
        }
    }

    @Override
    public void processElement(StreamRecord<Event> record) throws Exception {
        Event e = record.getValue();
        if (e.kind == Event.EARLY_LABEL) {
            early(e);
        } else if (e.ts <= watermark) {
            late(e);
        } else {
            schedule(e);
            arrived(e);
        }
    }

    /** An early label ({@link Event#EARLY_LABEL}): handled on arrival, never buffered. The
     *  default drops it; a stage between the user stage and the label join passes it on. */
    protected void early(Event e) throws Exception {}

    /** Called for each event when it arrives ahead of the watermark, after it was buffered for
     *  its turn (the current key is its key): what a stage may do before event time reaches it. */
    protected void arrived(Event e) throws Exception {}

    /** The current key's state as event time has left it (for {@link #arrived}: read only). */
    protected final S peek(long key) throws Exception {
        return load(key);
    }

    /**
     * An event at or behind this stage's watermark: its key's later events may be applied
     * already. Only the first stage can see one in a healthy job (idle partitions aside), and
     * it sends it to the DLQ; later stages apply it late (its counts may include later events).
     */
    protected void late(Event e) throws Exception {
        schedule(e);
    }

    /** Apply {@code e} to its key's state once the watermark reaches {@code e.ts} (for a
     *  stage's own deadlines too: an event the stage makes up for a later time). */
    protected final void schedule(Event e) {
        buffer.computeIfAbsent(e.ts >> BUCKET_BITS, t -> new ArrayList<>()).add(e);
    }

    @Override
    public void processWatermark(Watermark mark) throws Exception {
        watermark = Math.max(watermark, mark.getTimestamp());
        while (drain(mark.getTimestamp())) {
            // again: applying events may schedule more at or before the watermark (the end of input's)
        }
        if (features != null && watermark > publishedWatermark) {
            // after every record of the events this watermark covers, in each partition (their reader's "as of")
            publishedWatermark = watermark;
            int subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
            int parallelism = getRuntimeContext().getTaskInfo().getNumberOfParallelSubtasks();
            for (int p = 0; p < features.partitions; p++) {
                emitFeature(features.watermark(subtask, parallelism, p, watermark));
            }
        }
        super.processWatermark(mark);
    }

    /** Apply every buffered event at or before {@code watermark}; false if there was none. */
    private boolean drain(long watermark) throws Exception {
        long edge = watermark >> BUCKET_BITS;
        SortedMap<Long, List<Event>> due = buffer.headMap(edge, false);
        List<Event> ready = new ArrayList<>();
        due.values().forEach(ready::addAll);
        due.clear();
        List<Event> partly = buffer.get(edge);
        if (partly != null) {
            List<Event> waiting = new ArrayList<>();
            for (Event e : partly) {
                (e.ts <= watermark ? ready : waiting).add(e);
            }
            if (waiting.isEmpty()) {
                buffer.remove(edge);
            } else {
                buffer.put(edge, waiting);
            }
        }
        if (ready.isEmpty()) {
            return false;
        }
        // each key's run in time order, keys in ascending order: grouping, then small sorts
        // (one sort of all the ready events by (key, time) was a tenth of the stage's CPU)
        for (Event e : ready) {
            runs.computeIfAbsent(keyOf(e), k -> new ArrayList<>()).add(e);
        }
        long[] keys = new long[runs.size()];
        int n = 0;
        for (Long key : runs.keySet()) {
            keys[n++] = key;
        }
        Arrays.sort(keys);
        for (long key : keys) {
            List<Event> run = runs.get(key);
            run.sort(Event::compareInTime);
            S s = load(key);
            setCurrentKey(key); // apply may use the stage's other keyed state
            long[] expiring = features == null ? null
                    : features.bucketsUpTo(counterOf(s), run.get(run.size() - 1).ts - features.maxWindowMs);
            for (Event e : run) {
                apply(s, e);
            }
            if (features != null) {
                publish(key, s, run, expiring);
            }
            if (cache != null) {
                cache.markDirty(key);
            } else {
                state.update(s);
            }
        }
        runs.clear();
        return true;
    }

    /** The key's changed buckets (one record each, coalescing the run's events), tombstones
     *  for the buckets it emptied, then whatever else the stage publishes. */
    private void publish(long key, S s, List<Event> run, long[] expiring) {
        WindowCounter counter = counterOf(s);
        long last = Long.MIN_VALUE;
        for (Event e : run) { // in time order: buckets ascend
            if (e.kind != Event.IMPRESSION && e.kind != Event.CLICK) continue;
            long bucket = features.bucketOf(e.ts);
            if (bucket != last) {
                last = bucket;
                Tuple3<Integer, byte[], byte[]> record = features.bucket(key, counter, bucket);
                if (record != null) emitFeature(record);
            }
        }
        for (long bucket : expiring) {
            if (!features.holds(counter, bucket)) emitFeature(features.tombstone(key, bucket));
        }
        publishMore(key, s, run);
    }

    private S load(long key) throws Exception {
        S s = cache == null ? null : cache.get(key);
        if (s == null) {
            setCurrentKey(key);
            s = state.value();
            if (s == null) {
                s = newState();
            }
            if (cache != null) {
                cache.put(key, s, this::writeBack);
            }
        }
        return s;
    }

    private void writeBack(long key, S s) throws Exception {
        setCurrentKey(key);
        state.update(s);
    }

    @Override
    public void snapshotState(StateSnapshotContext context) throws Exception {
        super.snapshotState(context);
        if (cache != null) {
            cache.drainDirty(this::writeBack); // before the backend's snapshot, which follows this call
        }
        KeyGroupSnapshot.write(context.getRawKeyedOperatorStateOutput(),
                getRuntimeContext().getTaskInfo().getMaxNumberOfParallelSubtasks(), this::bufferedEvents, this::keyOf,
                EVENTS::serialize);
    }

    private java.util.Iterator<Event> bufferedEvents() {
        return buffer.values().stream().flatMap(List::stream).iterator();
    }
}
