package streamrec.flink;

import java.io.Serializable;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;

/**
 * The sample's Kafka encoding (pipelines/sample_wire.py, schema version 1): one JSON object
 * per sample, keys = the schema's column names. Written by hand, straight into bytes: the
 * field set is fixed, and a StringBuilder + getBytes took a tenth of the job's CPU.
 * {@link #unlabelled} stops before the label; the category stage appends it and closes it.
 */
public final class SampleJson implements Serializable {
    private static final long serialVersionUID = 1L;
    private final int sampleVersion;
    private final byte[][] counterNames; // per window: user imps/clicks, item imps/clicks, category imps/clicks

    public SampleJson(int sampleVersion, long[] windowsS) {
        this.sampleVersion = sampleVersion;
        this.counterNames = new byte[windowsS.length * 6][];
        String[] entities = {"user", "item", "category"};
        String[] what = {"imps", "clicks"};
        int n = 0;
        for (long w : windowsS) {
            for (String entity : entities) {
                for (String x : what) {
                    counterNames[n++] = ascii(",\"" + entity + "_" + x + "_" + w + "s\":");
                }
            }
        }
    }

    private static final byte[] VERSION = ascii("{\"sample_version\":");
    private static final byte[] EVENT_ID = ascii(",\"event_id\":");
    private static final byte[] REQUEST_ID = ascii(",\"request_id\":");
    private static final byte[] TS = ascii(",\"ts\":");
    private static final byte[] USER_ID = ascii(",\"user_id\":");
    private static final byte[] ITEM_ID = ascii(",\"item_id\":");
    private static final byte[] POSITION = ascii(",\"position\":");
    private static final byte[] DEVICE = ascii(",\"device\":");
    private static final byte[] LOCAL_HOUR = ascii(",\"local_hour\":");
    private static final byte[] CATEGORY_ID = ascii(",\"category_id\":");
    private static final byte[] ADVERTISER_ID = ascii(",\"advertiser_id\":");
    private static final byte[] HIST_ITEMS = ascii(",\"hist_item_ids\":");
    private static final byte[] HIST_CATEGORIES = ascii(",\"hist_category_ids\":");

    static byte[] ascii(String s) {
        return s.getBytes(StandardCharsets.US_ASCII);
    }

    static byte[] key(long userId) {
        return ascii(Long.toString(userId));
    }

    /** The sample without its label: {"sample_version":1, ..., "category_clicks_600s":N */
    public byte[] unlabelled(Event e, int[] categoryCounts) {
        Bytes b = new Bytes(768);
        b.put(VERSION).num(sampleVersion);
        b.put(EVENT_ID).string(e.eventId);
        b.put(REQUEST_ID).string(e.requestId);
        b.put(TS).num(e.ts);
        b.put(USER_ID).num(e.userId);
        b.put(ITEM_ID).num(e.itemId);
        b.put(POSITION).num(e.position);
        b.put(DEVICE).string(e.device);
        b.put(LOCAL_HOUR).num(e.localHour);
        b.put(CATEGORY_ID).num(e.categoryId);
        b.put(ADVERTISER_ID).num(e.advertiserId);
        b.put(HIST_ITEMS).nums(e.histItems);
        b.put(HIST_CATEGORIES).nums(e.histCategories);
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
