package streamrec.flink;

import java.io.IOException;

import org.apache.flink.api.common.typeutils.SimpleTypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;

/**
 * Point-in-time impression and click counts of one entity (a user, an item or a category): the
 * entity's event times within the largest window, fed in event-time order. Counts are over
 * the open interval (ts - W, ts): events at the same millisecond are not visible
 * (docs/samples.md). Layout of {@link #counts}: [imps W0, clicks W0, imps W1, clicks W1, ...].
 */
public final class WindowCounter {
    TimeRing imps = new TimeRing();
    TimeRing clicks = new TimeRing();

    public void add(int kind, long ts, long maxWindowMs) {
        (kind == Event.IMPRESSION ? imps : clicks).add(ts);
        imps.expire(ts - maxWindowMs);
        clicks.expire(ts - maxWindowMs);
    }

    public int[] counts(long ts, long[] windowsMs) {
        int[] out = new int[windowsMs.length * 2];
        for (int i = 0; i < windowsMs.length; i++) {
            out[2 * i] = imps.countBetween(ts - windowsMs[i], ts);
            out[2 * i + 1] = clicks.countBetween(ts - windowsMs[i], ts);
        }
        return out;
    }

    /** The counter's encoding in the state backend (times as varint gaps, StateCodec). */
    public static final class Serializer extends StateSerializer<WindowCounter> {
        @Override
        public WindowCounter createInstance() {
            return new WindowCounter();
        }

        @Override
        public void serialize(WindowCounter c, DataOutputView out) throws IOException {
            write(c, out);
        }

        @Override
        public WindowCounter deserialize(DataInputView in) throws IOException {
            return read(in);
        }

        /** Also the user state's counter (UserStage). */
        static void write(WindowCounter c, DataOutputView out) throws IOException {
            StateCodec.writeTimes(out, c.imps);
            StateCodec.writeTimes(out, c.clicks);
        }

        static WindowCounter read(DataInputView in) throws IOException {
            WindowCounter c = new WindowCounter();
            c.imps = StateCodec.readTimes(in);
            c.clicks = StateCodec.readTimes(in);
            return c;
        }

        @Override
        public TypeSerializerSnapshot<WindowCounter> snapshotConfiguration() {
            return new Snapshot();
        }

        /** Restores the serializer from a checkpoint. */
        public static final class Snapshot extends SimpleTypeSerializerSnapshot<WindowCounter> {
            public Snapshot() {
                super(Serializer::new);
            }
        }
    }
}
