package streamrec.flink;

import java.io.IOException;
import java.nio.charset.StandardCharsets;

import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;

/** Compact encodings of the accumulators' fields (see {@link StateSerializer}). */
final class StateCodec {
    private StateCodec() {}

    /** Ascending times as the first time and then varint gaps: ~1-2 bytes per event. */
    static void writeTimes(DataOutputView out, TimeRing ring) throws IOException {
        int n = ring.end - ring.start;
        out.writeInt(n);
        if (n == 0) {
            return;
        }
        byte[] buf = new byte[9 + 5 * (n - 1)];
        int at = 0;
        long prev = ring.times[ring.start];
        out.writeLong(prev);
        for (int i = ring.start + 1; i < ring.end; i++) {
            long gap = ring.times[i] - prev;
            prev = ring.times[i];
            if (gap < 0 || gap > Integer.MAX_VALUE) { // cannot happen for ordered times < 24 days apart
                throw new IOException("event times out of order or too far apart in a TimeRing");
            }
            while (gap >= 0x80) {
                buf[at++] = (byte) (gap | 0x80);
                gap >>>= 7;
            }
            buf[at++] = (byte) gap;
        }
        out.writeInt(at);
        out.write(buf, 0, at);
    }

    static TimeRing readTimes(DataInputView in) throws IOException {
        TimeRing ring = new TimeRing();
        int n = in.readInt();
        if (n == 0) {
            return ring;
        }
        long[] times = new long[Math.max(8, Integer.highestOneBit(n) << 1)];
        times[0] = in.readLong();
        byte[] buf = new byte[in.readInt()];
        in.readFully(buf);
        int at = 0;
        for (int i = 1; i < n; i++) {
            long gap = 0;
            int shift = 0;
            byte b;
            do {
                b = buf[at++];
                gap |= (long) (b & 0x7f) << shift;
                shift += 7;
            } while (b < 0);
            times[i] = times[i - 1] + gap;
        }
        ring.times = times;
        ring.start = 0;
        ring.end = n;
        return ring;
    }

    static void writeLongs(DataOutputView out, long[] values) throws IOException {
        out.writeInt(values.length);
        for (long v : values) {
            out.writeLong(v);
        }
    }

    static long[] readLongs(DataInputView in) throws IOException {
        long[] values = new long[in.readInt()];
        for (int i = 0; i < values.length; i++) {
            values[i] = in.readLong();
        }
        return values;
    }

    static void writeStrings(DataOutputView out, String[] values) throws IOException {
        out.writeInt(values.length);
        for (String v : values) {
            writeString(out, v);
        }
    }

    static String[] readStrings(DataInputView in) throws IOException {
        String[] values = new String[in.readInt()];
        for (int i = 0; i < values.length; i++) {
            values[i] = readString(in);
        }
        return values;
    }

    /**
     * A string as UTF-8 bytes (null allowed). Not writeUTF or Flink's StringValue: both go
     * char by char, and StringValue reads back two-byte (UTF-16) strings, which made every
     * later use of an id several times slower (a profile's top entry).
     */
    @SuppressWarnings("deprecation") // String.getBytes(int, int, byte[], int): the low byte of each char, no allocation
    static void writeString(DataOutputView out, String s) throws IOException {
        if (s == null) {
            out.writeInt(-1);
            return;
        }
        int n = s.length();
        if (n <= SCRATCH_BYTES && isAscii(s)) { // ids and device names: UTF-8 = one byte per char
            byte[] scratch = SCRATCH.get();
            s.getBytes(0, n, scratch, 0);
            out.writeInt(n);
            out.write(scratch, 0, n);
            return;
        }
        byte[] bytes = s.getBytes(StandardCharsets.UTF_8);
        out.writeInt(bytes.length);
        out.write(bytes);
    }

    static String readString(DataInputView in) throws IOException {
        int n = in.readInt();
        if (n < 0) {
            return null;
        }
        byte[] bytes = n <= SCRATCH_BYTES ? SCRATCH.get() : new byte[n];
        in.readFully(bytes, 0, n);
        return new String(bytes, 0, n, StandardCharsets.UTF_8);
    }

    private static boolean isAscii(String s) {
        for (int i = 0; i < s.length(); i++) {
            if (s.charAt(i) >= 0x80) return false;
        }
        return true;
    }

    // per thread (each stage runs in its own task thread): strings pass through it without an allocation
    private static final int SCRATCH_BYTES = 256;
    private static final ThreadLocal<byte[]> SCRATCH = ThreadLocal.withInitial(() -> new byte[SCRATCH_BYTES]);

    static void writeBooleans(DataOutputView out, boolean[] values) throws IOException {
        out.writeInt(values.length);
        for (boolean v : values) {
            out.writeBoolean(v);
        }
    }

    static boolean[] readBooleans(DataInputView in) throws IOException {
        boolean[] values = new boolean[in.readInt()];
        for (int i = 0; i < values.length; i++) {
            values[i] = in.readBoolean();
        }
        return values;
    }
}
