package streamrec.flink;

import java.io.IOException;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataInputViewStreamWrapper;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.runtime.state.KeyGroupRangeAssignment;
import org.apache.flink.runtime.state.KeyGroupStatePartitionStreamProvider;
import org.apache.flink.runtime.state.KeyGroupsList;
import org.apache.flink.runtime.state.KeyedStateCheckpointOutputStream;
import org.apache.flink.runtime.state.StateInitializationContext;

/**
 * An operator's in-memory keyed data written to (and read back from) raw keyed state, one
 * section per key group: a restore at another parallelism gives each subtask the entries
 * of the keys it owns. The stages keep their short-lived data (events waiting for the
 * watermark, label deadlines) in memory this way instead of writing it to the state
 * backend on every event.
 */
final class KeyGroupSnapshot {
    private KeyGroupSnapshot() {}

    interface Writer<T> {
        void write(T item, DataOutputView out) throws IOException;
    }

    interface Reader {
        void read(DataInputView in) throws IOException;
    }

    interface KeyOf<T> {
        Object key(T item);
    }

    static <T> void write(KeyedStateCheckpointOutputStream out, int maxParallelism, Iterable<T> items, KeyOf<T> keyOf,
                          Writer<T> writer) throws IOException {
        Map<Integer, List<T>> groups = new HashMap<>();
        for (T item : items) {
            int group = KeyGroupRangeAssignment.assignToKeyGroup(keyOf.key(item), maxParallelism);
            groups.computeIfAbsent(group, g -> new ArrayList<>()).add(item);
        }
        KeyGroupsList range = out.getKeyGroupList();
        DataOutputSerializer section = new DataOutputSerializer(4096); // one write per key group, not per field
        for (int i = 0; i < range.getNumberOfKeyGroups(); i++) {
            int group = range.getKeyGroupId(i);
            List<T> entries = groups.getOrDefault(group, List.of());
            section.clear();
            section.writeInt(entries.size());
            for (T item : entries) {
                writer.write(item, section);
            }
            out.startNewKeyGroup(group);
            out.write(section.getSharedBuffer(), 0, section.length());
        }
    }

    /** Calls {@code reader} once per entry this subtask restores (nothing on a fresh start). */
    static void read(StateInitializationContext context, Reader reader) throws Exception {
        if (!context.isRestored()) {
            return;
        }
        for (KeyGroupStatePartitionStreamProvider group : context.getRawKeyedStateInputs()) {
            DataInputViewStreamWrapper in = new DataInputViewStreamWrapper(group.getStream());
            for (int n = in.readInt(); n > 0; n--) {
                reader.read(in);
            }
        }
    }
}
