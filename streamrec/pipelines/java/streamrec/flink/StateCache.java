package streamrec.flink;

import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Recently used key states of one stage, in memory, in front of the state backend: a
 * write-back LRU. Why: with RocksDB every state read and write (de)serializes the whole
 * value and crosses JNI, and a hot key (a category, a popular item) is read and rewritten
 * on every watermark, a value of thousands of event times each time. Here a key's state is
 * read from the backend once, changed in memory, and written back only when it leaves the
 * cache or at a checkpoint ({@link #drainDirty}), so a checkpoint still holds every change.
 *
 * <p>Only in front of a backend that serializes on write (RocksDB): the heap backend's
 * asynchronous snapshots would otherwise see values the stage is still changing.
 */
final class StateCache<S> {
    interface WriteBack<S> {
        void write(long key, S state) throws Exception;
    }

    private static final class Entry<S> {
        final S state;
        boolean dirty;

        Entry(S state) {
            this.state = state;
        }
    }

    private final int capacity;
    private final LinkedHashMap<Long, Entry<S>> entries;
    private long hits;
    private long misses;

    StateCache(int capacity) {
        this.capacity = capacity;
        this.entries = new LinkedHashMap<>(Math.min(capacity, 1 << 16) * 2, 0.75f, true);
    }

    /** The cached state of {@code key}, or null (then load it and {@link #put} it). */
    S get(long key) {
        Entry<S> e = entries.get(key);
        if (e == null) {
            misses++;
            return null;
        }
        hits++;
        return e.state;
    }

    /** Cache a state just read from the backend; evicts (writing back) the least recently used. */
    void put(long key, S state, WriteBack<S> writeBack) throws Exception {
        entries.put(key, new Entry<>(state));
        Iterator<Map.Entry<Long, Entry<S>>> oldest = entries.entrySet().iterator();
        while (entries.size() > capacity) {
            Map.Entry<Long, Entry<S>> victim = oldest.next();
            oldest.remove();
            if (victim.getValue().dirty) {
                writeBack.write(victim.getKey(), victim.getValue().state);
            }
        }
    }

    /** The state of {@code key} (cached) has changed. */
    void markDirty(long key) {
        entries.get(key).dirty = true;
    }

    /** Write every changed state back (before a checkpoint); they stay cached, clean. */
    void drainDirty(WriteBack<S> writeBack) throws Exception {
        for (Map.Entry<Long, Entry<S>> e : entries.entrySet()) {
            if (e.getValue().dirty) {
                writeBack.write(e.getKey(), e.getValue().state);
                e.getValue().dirty = false;
            }
        }
    }

    long hits() {
        return hits;
    }

    long misses() {
        return misses;
    }
}
