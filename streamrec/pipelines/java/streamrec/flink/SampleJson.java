package streamrec.flink;

import java.io.Serializable;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Map;
import java.util.TreeSet;

/**
 * The sample's Kafka encoding (pipelines/sample_wire.py): one JSON object per sample, keys =
 * the schema's column names. The field table is the feature spec's (pipelines/feature_spec.py,
 * handed over at job build as {@code sample_fields} and {@code counter_columns}): this class
 * knows how to write each fixed field of an {@link Event}, not which fields a sample has or
 * what they are called. Written straight into bytes: a StringBuilder + getBytes took a tenth
 * of the job's CPU. {@link #unlabelled} stops before the label; the category stage appends it
 * and closes the object.
 */
public final class SampleJson implements Serializable {
    private static final long serialVersionUID = 2L;

    /** Writes one fixed field's value of an event. */
    private interface Writer extends Serializable {
        void write(Bytes b, Event e, int sampleVersion);
    }

    private static final Map<String, Writer> WRITERS = new HashMap<>();

    static {
        WRITERS.put("sample_version", (b, e, v) -> b.num(v));
        WRITERS.put("event_id", (b, e, v) -> b.string(e.eventId));
        WRITERS.put("request_id", (b, e, v) -> b.string(e.requestId));
        WRITERS.put("ts", (b, e, v) -> b.num(e.ts));
        WRITERS.put("user_id", (b, e, v) -> b.num(e.userId));
        WRITERS.put("item_id", (b, e, v) -> b.num(e.itemId));
        WRITERS.put("position", (b, e, v) -> b.num(e.position));
        WRITERS.put("device", (b, e, v) -> b.string(e.device));
        WRITERS.put("local_hour", (b, e, v) -> b.num(e.localHour));
        WRITERS.put("category_id", (b, e, v) -> b.num(e.categoryId));
        WRITERS.put("advertiser_id", (b, e, v) -> b.num(e.advertiserId));
        WRITERS.put("hist_item_ids", (b, e, v) -> b.nums(e.histItems));
        WRITERS.put("hist_category_ids", (b, e, v) -> b.nums(e.histCategories));
    }

    private final int sampleVersion;
    private final byte[][] fieldNames; // "{\"name\":" for the first, ",\"name\":" for the others
    private final Writer[] fieldWriters;
    private final byte[][] counterNames; // per window: user imps/clicks, item imps/clicks, category imps/clicks

    /**
     * @param fields the fixed fields, in order (comma-separated)
     * @param counterColumns the counter columns, window by window, each window's user, item
     *     and category imps/clicks: the order of the stages' count arrays
     */
    public SampleJson(int sampleVersion, String fields, String counterColumns, int windows) {
        this.sampleVersion = sampleVersion;
        String[] names = fields.split(",");
        this.fieldNames = new byte[names.length][];
        this.fieldWriters = new Writer[names.length];
        for (int i = 0; i < names.length; i++) {
            Writer w = WRITERS.get(names[i]);
            if (w == null) {
                throw new IllegalArgumentException("the feature spec names a sample field '" + names[i]
                        + "' this job cannot produce (it writes " + new TreeSet<>(WRITERS.keySet()) + ")");
            }
            fieldWriters[i] = w;
            fieldNames[i] = ascii((i == 0 ? "{\"" : ",\"") + names[i] + "\":");
        }
        String[] counters = counterColumns.split(",");
        if (counters.length != windows * 6) {
            throw new IllegalArgumentException(counters.length + " counter columns for " + windows + " windows; expected "
                    + windows * 6 + " (user, item, category x imps, clicks per window)");
        }
        this.counterNames = new byte[counters.length][];
        for (int i = 0; i < counters.length; i++) {
            counterNames[i] = ascii(",\"" + counters[i] + "\":");
        }
    }

    static byte[] ascii(String s) {
        return s.getBytes(StandardCharsets.US_ASCII);
    }

    static byte[] key(long userId) {
        return ascii(Long.toString(userId));
    }

    /** The sample without its label: {"sample_version":1, ..., "category_clicks_600s":N */
    public byte[] unlabelled(Event e, int[] categoryCounts) {
        Bytes b = new Bytes(768);
        for (int i = 0; i < fieldWriters.length; i++) {
            b.put(fieldNames[i]);
            fieldWriters[i].write(b, e, sampleVersion);
        }
        int[][] byEntity = {e.userCounts, e.itemCounts, categoryCounts};
        for (int w = 0; w < counterNames.length / 6; w++) {
            for (int entity = 0; entity < 3; entity++) {
                for (int x = 0; x < 2; x++) {
                    b.put(counterNames[w * 6 + entity * 2 + x]).num(byEntity[entity][2 * w + x]);
                }
            }
        }
        return b.toArray();
    }

    /** A growable byte buffer with JSON number and string writers. */
    static final class Bytes {
        private static final byte[] TENS = new byte[100], ONES = new byte[100]; // the two digits of 0..99

        static {
            for (int i = 0; i < 100; i++) {
                TENS[i] = (byte) ('0' + i / 10);
                ONES[i] = (byte) ('0' + i % 10);
            }
        }

        private byte[] buf;
        private int n;

        Bytes(int capacity) {
            buf = new byte[capacity];
        }

        private void room(int more) {
            if (n + more > buf.length) {
                buf = Arrays.copyOf(buf, Math.max(buf.length * 2, n + more));
            }
        }

        Bytes put(byte[] bytes) {
            room(bytes.length);
            System.arraycopy(bytes, 0, buf, n, bytes.length);
            n += bytes.length;
            return this;
        }

        Bytes num(long v) {
            room(20);
            if (v == Long.MIN_VALUE) {
                return put(ascii(Long.toString(v)));
            }
            if (v < 0) {
                buf[n++] = '-';
                v = -v;
            }
            int end = n + digits(v);
            int at = end;
            while (v >= 100) { // two digits per division
                int r = (int) (v % 100);
                v /= 100;
                buf[--at] = ONES[r];
                buf[--at] = TENS[r];
            }
            if (v >= 10) {
                buf[--at] = ONES[(int) v];
                buf[--at] = TENS[(int) v];
            } else {
                buf[--at] = (byte) ('0' + v);
            }
            n = end;
            return this;
        }

        /** The number of decimal digits of {@code v} >= 0. */
        private static int digits(long v) {
            long limit = 10;
            for (int d = 1; d < 19; d++, limit *= 10) {
                if (v < limit) return d;
            }
            return 19;
        }

        Bytes nums(long[] values) {
            room(1);
            buf[n++] = '[';
            for (int i = 0; i < values.length; i++) {
                if (i > 0) {
                    room(1);
                    buf[n++] = ',';
                }
                num(values[i]);
            }
            room(1);
            buf[n++] = ']';
            return this;
        }

        /** A JSON string literal (RFC 8259 escapes; non-ASCII passes through as UTF-8). */
        Bytes string(String s) {
            byte[] utf8 = s.getBytes(StandardCharsets.UTF_8);
            room(utf8.length * 6 + 2);
            buf[n++] = '"';
            for (byte c : utf8) {
                if (c == '"' || c == '\\') {
                    buf[n++] = '\\';
                    buf[n++] = c;
                } else if (c >= 0 && c < 0x20) {
                    byte[] esc = ascii(String.format("\\u%04x", (int) c));
                    System.arraycopy(esc, 0, buf, n, esc.length);
                    n += esc.length;
                } else {
                    buf[n++] = c;
                }
            }
            buf[n++] = '"';
            return this;
        }

        byte[] toArray() {
            return Arrays.copyOf(buf, n);
        }
    }
}
