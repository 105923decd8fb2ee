package streamrec.flink;

import java.io.IOException;
import java.util.Arrays;

import org.apache.flink.api.common.typeutils.SimpleTypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.functions.AggregateFunction;
import org.apache.flink.types.Row;

/**
 * Everything the job knows per user, in one pass over the user's events in event-time order.
 *
 * <p>Used as {@code OVER (PARTITION BY user_id ORDER BY rowtime ROWS UNBOUNDED PRECEDING)}
 * on the user's valid impressions (kind 0) and clicks (kind 1). Per row it answers:
 * <ul>
 *   <li>{@code dup}: the same event_id was already seen at this event time (an at-least-once
 *       repeat upstream); the row must be ignored;</li>
 *   <li>for a click: {@code joined} (an impression of the same (request_id, item_id) at or
 *       before it, at most the attribution window earlier), {@code first_click} (the first
 *       click to join that impression: it carries the label) and the impression's
 *       {@code category_id};</li>
 *   <li>for an impression: the user's impression/click counts over (ts - W, ts) and the last
 *       {@code historyLen} joined clicks strictly before ts (most recent first).</li>
 * </ul>
 * Clicks join inside the user's partition because events are keyed by user upstream; doing
 * it here instead of in an interval join avoids holding every feature back by the
 * attribution window (the interval join delays its watermark by that much).
 */
@FunctionHint(
        accumulator = @DataTypeHint(value = "RAW", bridgedTo = UserFeatures.Acc.class,
                rawSerializer = UserFeatures.AccSerializer.class),
        output = @DataTypeHint(
        "ROW<dup BOOLEAN, joined BOOLEAN, first_click BOOLEAN, category_id BIGINT, counts ARRAY<INT>,"
                + " hist_item_ids ARRAY<BIGINT>, hist_category_ids ARRAY<BIGINT>>"))
public class UserFeatures extends AggregateFunction<Row, UserFeatures.Acc> {

    /** One user's state. */
    public static class Acc {
        public long[] windowsMs = new long[0];
        public long attributionMs;
        public int historyLen;

        public long lastTs = Long.MIN_VALUE;
        public String[] idsAtLastTs = new String[0];
        public TimeRing imps = new TimeRing();
        public TimeRing clicks = new TimeRing();

        // joined clicks, most recent first: the behaviour sequence
        public long[] histItem = new long[0];
        public long[] histCat = new long[0];
        public long[] histTs = new long[0];
        // event ids of the leading entries that share histTs[0], in the same (descending) order
        public String[] histHeadIds = new String[0];

        // impressions a click can still join (ts + attribution window not yet passed)
        public String[] openKey = new String[0];
        public long[] openTs = new long[0];
        public long[] openCat = new long[0];
        public boolean[] openClicked = new boolean[0];

        // what the last row was, for getValue
        public int lastKind;
        public boolean lastDup;
        public boolean lastJoined;
        public boolean lastFirstClick;
        public long lastCategory;

        public Acc() {}
    }

    /** The state's encoding (a RAW type: see {@link StateSerializer}). */
    public static final class AccSerializer extends StateSerializer<Acc> {
        @Override
        public Acc createInstance() {
            return new Acc();
        }

        @Override
        public void serialize(Acc acc, DataOutputView out) throws IOException {
            StateCodec.writeLongs(out, acc.windowsMs);
            out.writeLong(acc.attributionMs);
            out.writeInt(acc.historyLen);
            out.writeLong(acc.lastTs);
            StateCodec.writeStrings(out, acc.idsAtLastTs);
            StateCodec.writeTimes(out, acc.imps);
            StateCodec.writeTimes(out, acc.clicks);
            StateCodec.writeLongs(out, acc.histItem);
            StateCodec.writeLongs(out, acc.histCat);
            StateCodec.writeLongs(out, acc.histTs);
            StateCodec.writeStrings(out, acc.histHeadIds);
            StateCodec.writeStrings(out, acc.openKey);
            StateCodec.writeLongs(out, acc.openTs);
            StateCodec.writeLongs(out, acc.openCat);
            StateCodec.writeBooleans(out, acc.openClicked);
            out.writeInt(acc.lastKind);
            out.writeBoolean(acc.lastDup);
            out.writeBoolean(acc.lastJoined);
            out.writeBoolean(acc.lastFirstClick);
            out.writeLong(acc.lastCategory);
        }

        @Override
        public Acc deserialize(DataInputView in) throws IOException {
            Acc acc = new Acc();
            acc.windowsMs = StateCodec.readLongs(in);
            acc.attributionMs = in.readLong();
            acc.historyLen = in.readInt();
            acc.lastTs = in.readLong();
            acc.idsAtLastTs = StateCodec.readStrings(in);
            acc.imps = StateCodec.readTimes(in);
            acc.clicks = StateCodec.readTimes(in);
            acc.histItem = StateCodec.readLongs(in);
            acc.histCat = StateCodec.readLongs(in);
            acc.histTs = StateCodec.readLongs(in);
            acc.histHeadIds = StateCodec.readStrings(in);
            acc.openKey = StateCodec.readStrings(in);
            acc.openTs = StateCodec.readLongs(in);
            acc.openCat = StateCodec.readLongs(in);
            acc.openClicked = StateCodec.readBooleans(in);
            acc.lastKind = in.readInt();
            acc.lastDup = in.readBoolean();
            acc.lastJoined = in.readBoolean();
            acc.lastFirstClick = in.readBoolean();
            acc.lastCategory = in.readLong();
            return acc;
        }

        @Override
        public TypeSerializerSnapshot<Acc> snapshotConfiguration() {
            return new Snapshot();
        }

        /** Restores the serializer from a checkpoint. */
        public static final class Snapshot extends SimpleTypeSerializerSnapshot<Acc> {
            public Snapshot() {
                super(AccSerializer::new);
            }
        }
    }

    @Override
    public Acc createAccumulator() {
        return new Acc();
    }

    public void accumulate(Acc acc, Long ts, Integer kind, String eventId, String requestId, Long itemId,
                           Long categoryId, String windows, Long attributionMs, Integer historyLen) {
        if (acc.windowsMs.length == 0) {
            acc.windowsMs = Windows.parse(windows);
            acc.attributionMs = attributionMs;
            acc.historyLen = historyLen;
        }
        if (ts != acc.lastTs) {
            acc.lastTs = ts;
            acc.idsAtLastTs = new String[0];
        }
        acc.lastKind = kind;
        acc.lastJoined = false;
        acc.lastFirstClick = false;
        acc.lastDup = contains(acc.idsAtLastTs, eventId);
        if (acc.lastDup) {
            return;
        }
        acc.idsAtLastTs = append(acc.idsAtLastTs, eventId);
        expireOpen(acc, ts);
        String key = requestId + '\u0001' + itemId;
        if (kind == 0) {
            acc.imps.add(ts);
            acc.lastCategory = categoryId;
            acc.openKey = append(acc.openKey, key);
            acc.openTs = Arrays.copyOf(acc.openTs, acc.openTs.length + 1);
            acc.openTs[acc.openTs.length - 1] = ts;
            acc.openCat = Arrays.copyOf(acc.openCat, acc.openCat.length + 1);
            acc.openCat[acc.openCat.length - 1] = categoryId;
            acc.openClicked = Arrays.copyOf(acc.openClicked, acc.openClicked.length + 1);
        } else {
            for (int i = 0; i < acc.openKey.length; i++) {
                if (acc.openKey[i].equals(key)) { // open impressions are within the window by construction
                    acc.lastJoined = true;
                    acc.lastFirstClick = !acc.openClicked[i];
                    acc.openClicked[i] = true;
                    acc.lastCategory = acc.openCat[i];
                    break;
                }
            }
            if (acc.lastJoined) {
                acc.clicks.add(ts);
                remember(acc, itemId, acc.lastCategory, ts, eventId);
            }
        }
        long cutoff = ts - Windows.max(acc.windowsMs);
        acc.imps.expire(cutoff);
        acc.clicks.expire(cutoff);
    }

    @Override
    public Row getValue(Acc acc) {
        if (acc.lastDup) {
            return Row.of(true, false, false, null, null, null, null);
        }
        if (acc.lastKind != 0) {
            return Row.of(false, acc.lastJoined, acc.lastFirstClick, acc.lastJoined ? acc.lastCategory : null, null, null, null);
        }
        Integer[] counts = new Integer[acc.windowsMs.length * 2];
        for (int i = 0; i < acc.windowsMs.length; i++) {
            long lo = acc.lastTs - acc.windowsMs[i];
            counts[2 * i] = acc.imps.countBetween(lo, acc.lastTs);
            counts[2 * i + 1] = acc.clicks.countBetween(lo, acc.lastTs);
        }
        int skip = 0;
        while (skip < acc.histTs.length && acc.histTs[skip] >= acc.lastTs) {
            skip++; // clicks at this very millisecond are not visible yet
        }
        int n = Math.min(acc.historyLen, acc.histTs.length - skip);
        Long[] items = new Long[n];
        Long[] cats = new Long[n];
        for (int i = 0; i < n; i++) {
            items[i] = acc.histItem[skip + i];
            cats[i] = acc.histCat[skip + i];
        }
        return Row.of(false, false, false, acc.lastCategory, counts, items, cats);
    }

    /** Put a joined click at the front of the sequence; keep historyLen older ones besides
     *  those at the current millisecond (not yet visible to an impression at this time).
     *  Clicks of one millisecond are ordered by event id (the largest is the most recent),
     *  not by arrival, so the sequence does not depend on how partitions interleave. */
    private static void remember(Acc acc, long item, long category, long ts, String eventId) {
        int head = acc.histTs.length > 0 && acc.histTs[0] == ts ? acc.histHeadIds.length : 0;
        int at = 0;
        while (at < head && acc.histHeadIds[at].compareTo(eventId) > 0) {
            at++;
        }
        acc.histHeadIds = insert(head == 0 ? new String[0] : acc.histHeadIds, at, eventId);
        int keep = Math.min(acc.histTs.length + 1, head + 1 + acc.historyLen);
        acc.histItem = insert(acc.histItem, at, item, keep);
        acc.histCat = insert(acc.histCat, at, category, keep);
        acc.histTs = insert(acc.histTs, at, ts, keep);
    }

    private static void expireOpen(Acc acc, long ts) {
        int first = 0;
        while (first < acc.openTs.length && acc.openTs[first] + acc.attributionMs < ts) {
            first++;
        }
        if (first > 0) {
            acc.openKey = Arrays.copyOfRange(acc.openKey, first, acc.openKey.length);
            acc.openTs = Arrays.copyOfRange(acc.openTs, first, acc.openTs.length);
            acc.openCat = Arrays.copyOfRange(acc.openCat, first, acc.openCat.length);
            acc.openClicked = Arrays.copyOfRange(acc.openClicked, first, acc.openClicked.length);
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
}
