package streamrec.flink;

import java.io.IOException;

import org.apache.flink.api.common.typeutils.base.TypeSerializerSingleton;
import org.apache.flink.core.memory.DataInputDeserializer;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.core.memory.DataOutputView;

/**
 * Base of the hand-written serializers of the functions' accumulators.
 *
 * <p>Why: declared as structured types, the accumulators' arrays (a hot category holds tens
 * of thousands of event times) were converted element by element into Flink's binary
 * arrays on every access, which was the job's largest cost. As RAW types they stay Java
 * objects between rows and are only written when the state backend stores them, in the
 * compact encodings of {@link StateCodec}. Subclasses give the field order; a change of
 * layout needs a new snapshot version (checkpoints taken with the old one are refused).
 */
abstract class StateSerializer<T> extends TypeSerializerSingleton<T> {

    @Override
    public boolean isImmutableType() {
        return false;
    }

    @Override
    public T copy(T from) {
        try {
            DataOutputSerializer out = new DataOutputSerializer(256);
            serialize(from, out);
            return deserialize(new DataInputDeserializer(out.getSharedBuffer(), 0, out.length()));
        } catch (IOException e) {
            throw new IllegalStateException("copying a function's state failed", e);
        }
    }

    @Override
    public T copy(T from, T reuse) {
        return copy(from);
    }

    @Override
    public int getLength() {
        return -1;
    }

    @Override
    public T deserialize(T reuse, DataInputView source) throws IOException {
        return deserialize(source);
    }

    @Override
    public void copy(DataInputView source, DataOutputView target) throws IOException {
        serialize(deserialize(source), target);
    }
}
