package streamrec.flink;

import java.io.IOException;
import java.util.Arrays;

import org.apache.flink.api.common.typeutils.SimpleTypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;

/**
 * Everything the job knows per user, applied in event-time order (keyed by user_id).
 *
 * <ul>
 *   <li>Events at or behind the watermark on arrival are late: to the DLQ, unchanged.</li>
 *   <li>Duplicates (the same event_id again at the same event time: an at-least-once repeat
 *       upstream) are dropped.</li>
 *   <li>A click joins the user's open impression of the same (request_id, item_id) at most
 *       the attribution window earlier; it takes that impression's category_id and event id,
 *       and the first one to join carries the label. A click that joins nothing is an
 *       orphan: to the DLQ, unchanged.</li>
 *   <li>An impression gets the user's impression/click counts over (ts - W, ts) and the
 *       last {@code historyLen} joined clicks strictly before ts (most recent first).</li>
 * </ul>
 * Clicks join here, inside the user's partition, rather than in an interval join: the join
 * would hold every feature back by the attribution window. A click whose impression is
 * already applied also sends the label ahead of the watermark ({@link #arrived}).
 */
public final class UserStage extends EventTimeStage<UserStage.State, Event> {
    private static final long serialVersionUID = 1L;
    private final long[] windowsMs;
    private final long maxWindowMs;
    private final long attributionMs;
    private final int historyLen;
    private final String orphanReason;
    private final String lateReason;
    private transient StreamRecord<org.apache.flink.api.java.tuple.Tuple3<byte[], byte[], String>> dlqRecord;

    public UserStage(long[] windowsMs, long attributionMs, int historyLen, String orphanReason, String lateReason) {
        this.windowsMs = windowsMs;
        this.maxWindowMs = Arrays.stream(windowsMs).max().orElseThrow();
        this.attributionMs = attributionMs;
        this.historyLen = historyLen;
        this.orphanReason = orphanReason;
        this.lateReason = lateReason;
    }

    /** Late-data policy (docs/pipeline.md): to the DLQ, unchanged, so it can be replayed. */
    @Override
    protected void late(Event e) {
        toDlq(e, lateReason);
    }

    private void toDlq(Event e, String reason) {
        if (dlqRecord == null) {
            dlqRecord = new StreamRecord<>(null);
        }
        output.collect(Dlq.TAG, dlqRecord.replace(Dlq.record(e.key, e.raw, reason), e.ts));
    }

    /** One user's state. */
    public static final class State {
        long lastTs = Long.MIN_VALUE;
        String[] idsAtLastTs = new String[0]; // for dedup
        WindowCounter counter = new WindowCounter(); // the user's impression and joined-click times
        // joined clicks, most recent first: the behaviour sequence
        long[] histItem = new long[0];
        long[] histCat = new long[0];
        long[] histTs = new long[0];
        String[] histHeadIds = new String[0]; // event ids of the leading entries that share histTs[0], descending
        // impressions a click can still join (ts + attribution window not yet passed)
        String[] openKey = new String[0];
        String[] openId = new String[0];
        long[] openTs = new long[0];
        long[] openCat = new long[0];
        boolean[] openClicked = new boolean[0];
    }

    @Override
    protected long keyOf(Event e) {
        return e.userId;
    }

    @Override
    protected TypeSerializer<State> stateSerializer() {
        return new StateSerializerImpl();
    }

    @Override
    protected WindowCounter counterOf(State state) {
        return state.counter;
    }

    /** The click sequence, when the run had a click (it may have joined). */
    @Override
    protected void publishMore(long key, State s, java.util.List<Event> run) {
        for (Event e : run) {
            if (e.kind == Event.CLICK) {
                emitFeature(features().history(key, s.histItem, s.histCat, s.histTs));
                return;
            }
        }
    }

    /** A click that joins an impression this stage has already applied sends that impression's
     *  label on at once ({@link Event#EARLY_LABEL}): its sample's features were fixed when the
     *  impression was applied, so only the label was waiting, and it need not wait for the
     *  watermark to reach the click. The click itself is still applied in event time (counters,
     *  sequence, and the label again, a no-op if the early one found the sample). */
    @Override
    protected void arrived(Event e) throws Exception {
        if (e.kind != Event.CLICK) {
            return;
        }
        State s = peek(e.userId);
        String key = e.requestId + '\u0001' + e.itemId;
        for (int i = 0; i < s.openKey.length; i++) {
            if (s.openKey[i].equals(key)) { // the first open match: the one event time joins, too
                if (!s.openClicked[i] && s.openTs[i] + attributionMs >= e.ts) {
                    Event label = new Event();
                    label.kind = Event.EARLY_LABEL;
                    label.ts = e.ts;
                    label.eventId = e.eventId;
                    label.requestId = e.requestId;
                    label.userId = e.userId;
                    label.itemId = e.itemId;
                    label.categoryId = s.openCat[i];
                    label.impressionId = s.openId[i];
                    emit(label, e.ts);
                }
                return;
            }
        }
    }

    @Override
    protected State newState() {
        return new State();
    }

    @Override
    protected void apply(State s, Event e) {
        if (e.ts != s.lastTs) {
            s.lastTs = e.ts;
            s.idsAtLastTs = new String[0];
        }
        if (contains(s.idsAtLastTs, e.eventId)) {
            return; // a duplicate
        }
        if (e.kind == Event.IMPRESSION) {
            e.raw = null; // only an orphan click needs its payload after this stage
            e.key = null;
        }
        s.idsAtLastTs = append(s.idsAtLastTs, e.eventId);
        expireOpen(s, e.ts);
        String key = e.requestId + '\u0001' + e.itemId;
        if (e.kind == Event.IMPRESSION) {
            e.userCounts = s.counter.counts(e.ts, windowsMs);
            int skip = 0;
            while (skip < s.histTs.length && s.histTs[skip] >= e.ts) {
                skip++; // clicks at this very millisecond are not visible yet
            }
            int n = Math.min(historyLen, s.histTs.length - skip);
            e.histItems = Arrays.copyOfRange(s.histItem, skip, skip + n);
            e.histCategories = Arrays.copyOfRange(s.histCat, skip, skip + n);
            s.counter.add(Event.IMPRESSION, e.ts, maxWindowMs);
            s.openKey = append(s.openKey, key);
            s.openId = append(s.openId, e.eventId);
            s.openTs = Arrays.copyOf(s.openTs, s.openTs.length + 1);
            s.openTs[s.openTs.length - 1] = e.ts;
            s.openCat = Arrays.copyOf(s.openCat, s.openCat.length + 1);
            s.openCat[s.openCat.length - 1] = e.categoryId;
            s.openClicked = Arrays.copyOf(s.openClicked, s.openClicked.length + 1);
            emit(e, e.ts);
        } else {
            int joined = -1;
            for (int i = 0; i < s.openKey.length && joined < 0; i++) {
                if (s.openKey[i].equals(key)) { // open impressions are within the window by construction
                    joined = i;
                }
            }
            if (joined < 0) {
                toDlq(e, orphanReason);
            } else {
                e.firstClick = !s.openClicked[joined];
                s.openClicked[joined] = true;
                e.categoryId = s.openCat[joined];
                e.impressionId = s.openId[joined];
                e.raw = null;
                e.key = null;
                s.counter.add(Event.CLICK, e.ts, maxWindowMs);
                remember(s, e.itemId, e.categoryId, e.ts, e.eventId);
                emit(e, e.ts);
            }
        }
    }

    /** Put a joined click at the front of the sequence; keep historyLen older ones besides
     *  those at the current millisecond (not yet visible to an impression at this time).
     *  Clicks of one millisecond are ordered by event id (the largest is the most recent),
     *  not by arrival, so the sequence does not depend on how partitions interleave. */
    private void remember(State s, long item, long category, long ts, String eventId) {
        int head = s.histTs.length > 0 && s.histTs[0] == ts ? s.histHeadIds.length : 0;
        int at = 0;
        while (at < head && s.histHeadIds[at].compareTo(eventId) > 0) {
            at++;
        }
        s.histHeadIds = insert(head == 0 ? new String[0] : s.histHeadIds, at, eventId);
        int keep = Math.min(s.histTs.length + 1, head + 1 + historyLen);
        s.histItem = insert(s.histItem, at, item, keep);
        s.histCat = insert(s.histCat, at, category, keep);
        s.histTs = insert(s.histTs, at, ts, keep);
    }

    private void expireOpen(State s, long ts) {
        int first = 0;
        while (first < s.openTs.length && s.openTs[first] + attributionMs < ts) {
            first++;
        }
        if (first > 0) {
            s.openKey = Arrays.copyOfRange(s.openKey, first, s.openKey.length);
            s.openId = Arrays.copyOfRange(s.openId, first, s.openId.length);
            s.openTs = Arrays.copyOfRange(s.openTs, first, s.openTs.length);
            s.openCat = Arrays.copyOfRange(s.openCat, first, s.openCat.length);
            s.openClicked = Arrays.copyOfRange(s.openClicked, first, s.openClicked.length);
        }
    }

    /** values with x inserted at index at, cut to keep elements. */
    private static long[] insert(long[] values, int at, long x, int keep) {
        long[] out = new long[keep];
        System.arraycopy(values, 0, out, 0, at);
        out[at] = x;
        System.arraycopy(values, at, out, at + 1, keep - at - 1);
        return out;
    }

    private static String[] insert(String[] values, int at, String x) {
        String[] out = new String[values.length + 1];
        System.arraycopy(values, 0, out, 0, at);
        out[at] = x;
        System.arraycopy(values, at, out, at + 1, values.length - at);
        return out;
    }

    private static String[] append(String[] values, String tail) {
        String[] out = Arrays.copyOf(values, values.length + 1);
        out[values.length] = tail;
        return out;
    }

    private static boolean contains(String[] values, String x) {
        for (String v : values) {
            if (v.equals(x)) return true;
        }
        return false;
    }

    /** The state's encoding in the state backend. */
    public static final class StateSerializerImpl extends StateSerializer<State> {
        @Override
        public State createInstance() {
            return new State();
        }

        @Override
        public void serialize(State s, DataOutputView out) throws IOException {
            out.writeLong(s.lastTs);
            StateCodec.writeStrings(out, s.idsAtLastTs);
            WindowCounter.Serializer.write(s.counter, out);
            StateCodec.writeLongs(out, s.histItem);
            StateCodec.writeLongs(out, s.histCat);
            StateCodec.writeLongs(out, s.histTs);
            StateCodec.writeStrings(out, s.histHeadIds);
            StateCodec.writeStrings(out, s.openKey);
            StateCodec.writeStrings(out, s.openId);
            StateCodec.writeLongs(out, s.openTs);
            StateCodec.writeLongs(out, s.openCat);
            StateCodec.writeBooleans(out, s.openClicked);
        }

        @Override
        public State deserialize(DataInputView in) throws IOException {
            State s = new State();
            s.lastTs = in.readLong();
            s.idsAtLastTs = StateCodec.readStrings(in);
            s.counter = WindowCounter.Serializer.read(in);
            s.histItem = StateCodec.readLongs(in);
            s.histCat = StateCodec.readLongs(in);
            s.histTs = StateCodec.readLongs(in);
            s.histHeadIds = StateCodec.readStrings(in);
            s.openKey = StateCodec.readStrings(in);
            s.openId = StateCodec.readStrings(in);
            s.openTs = StateCodec.readLongs(in);
            s.openCat = StateCodec.readLongs(in);
            s.openClicked = StateCodec.readBooleans(in);
            return s;
        }

        @Override
        public TypeSerializerSnapshot<State> snapshotConfiguration() {
            return new Snapshot();
        }

        /** Restores the serializer from a checkpoint. */
        public static final class Snapshot extends SimpleTypeSerializerSnapshot<State> {
            public Snapshot() {
                super(StateSerializerImpl::new);
            }
        }
    }
}
