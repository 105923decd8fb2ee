package streamrec.flink;

import java.io.IOException;

import org.apache.flink.api.common.typeutils.SimpleTypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.functions.AggregateFunction;

/**
 * Point-in-time impression and click counts of one entity (an item or a category).
 *
 * <p>Used as {@code OVER (PARTITION BY entity ORDER BY rowtime ROWS UNBOUNDED PRECEDING)}
 * on a stream of impressions (kind 0) and joined clicks (kind 1). For each row at time ts
 * the value counts the entity's events in the open interval (ts - W, ts) for every window
 * W: events at the same millisecond are not visible (docs/samples.md). Result layout:
 * [imps W0, clicks W0, imps W1, clicks W1, ...].
 */
@FunctionHint(
        accumulator = @DataTypeHint(value = "RAW", bridgedTo = WindowCounts.Acc.class,
                rawSerializer = WindowCounts.AccSerializer.class),
        output = @DataTypeHint("ARRAY<INT>"))
public class WindowCounts extends AggregateFunction<Integer[], WindowCounts.Acc> {

    /** The entity's recent event times and the time of the row being answered. */
    public static class Acc {
        public long[] windowsMs = new long[0];
        public long lastTs = Long.MIN_VALUE;
        public TimeRing imps = new TimeRing();
        public TimeRing clicks = new TimeRing();

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
            out.writeLong(acc.lastTs);
            StateCodec.writeTimes(out, acc.imps);
            StateCodec.writeTimes(out, acc.clicks);
        }

        @Override
        public Acc deserialize(DataInputView in) throws IOException {
            Acc acc = new Acc();
            acc.windowsMs = StateCodec.readLongs(in);
            acc.lastTs = in.readLong();
            acc.imps = StateCodec.readTimes(in);
            acc.clicks = StateCodec.readTimes(in);
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

    /** {@code windows}: the windows in ms, comma-separated (a literal in the job's SQL). */
    public void accumulate(Acc acc, Long ts, Integer kind, String windows) {
        if (acc.windowsMs.length == 0) {
            acc.windowsMs = Windows.parse(windows);
        }
        acc.lastTs = ts;
        (kind == 0 ? acc.imps : acc.clicks).add(ts);
        long cutoff = ts - Windows.max(acc.windowsMs);
        acc.imps.expire(cutoff);
        acc.clicks.expire(cutoff);
    }

    @Override
    public Integer[] getValue(Acc acc) {
        Integer[] out = new Integer[acc.windowsMs.length * 2];
        for (int i = 0; i < acc.windowsMs.length; i++) {
            long lo = acc.lastTs - acc.windowsMs[i];
            out[2 * i] = acc.imps.countBetween(lo, acc.lastTs);
            out[2 * i + 1] = acc.clicks.countBetween(lo, acc.lastTs);
        }
        return out;
    }
}
