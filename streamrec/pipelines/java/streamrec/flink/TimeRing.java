package streamrec.flink;

/**
 * Ascending event times in a growable ring (one entity's impressions or clicks).
 *
 * <p>Events arrive in event-time order (the stages sort them), so appends go to the end and
 * expired times leave from the front: amortised O(1) per event, O(log n) per count.
 * Stored in the accumulators' state by {@link StateCodec#writeTimes}.
 */
public class TimeRing {
    public long[] times = new long[8];
    public int start = 0;
    public int end = 0;

    public TimeRing() {}

    public void add(long ts) {
        if (end == times.length) {
            int size = end - start;
            long[] grown = (size * 2 > times.length) ? new long[times.length * 2] : times;
            System.arraycopy(times, start, grown, 0, size);
            times = grown;
            start = 0;
            end = size;
        }
        int at = end++;
        while (at > start && times[at - 1] > ts) { // only a late event (EventTimeStage.late) moves any
            times[at] = times[at - 1];
            at--;
        }
        times[at] = ts;
    }

    /** Forget times at or before {@code cutoff}: no future window can contain them. */
    public void expire(long cutoff) {
        while (start < end && times[start] <= cutoff) {
            start++;
        }
        if (start == end) {
            start = 0;
            end = 0;
            if (times.length > 64) {
                times = new long[8];
            }
        } else if (times.length > 64 && (end - start) * 4 < times.length) {
            long[] shrunk = new long[times.length / 2];
            System.arraycopy(times, start, shrunk, 0, end - start);
            end -= start;
            start = 0;
            times = shrunk;
        }
    }

    /** How many times lie in the open interval (lo, hi). */
    public int countBetween(long lo, long hi) {
        return lowerBound(hi) - upperBound(lo);
    }

    int lowerBound(long x) { // first index with times[i] >= x
        int a = start, b = end;
        while (a < b) {
            int m = (a + b) >>> 1;
            if (times[m] < x) a = m + 1; else b = m;
        }
        return a;
    }

    private int upperBound(long x) { // first index with times[i] > x
        int a = start, b = end;
        while (a < b) {
            int m = (a + b) >>> 1;
            if (times[m] <= x) a = m + 1; else b = m;
        }
        return a;
    }
}
