package streamrec.flink;

import java.io.IOException;

import org.apache.flink.api.common.typeutils.SimpleTypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;

/**
 * {@link Event} on the wire between stages and in the stages' checkpointed buffers: a
 * presence bitmask, then only the fields that are set. Always deserializes into a new
 * object: the stages buffer records, so a reused instance would be overwritten under them.
 */
public final class EventSerializer extends StateSerializer<Event> {
    private static final int KEY = 1, RAW = 2, IMPRESSION_ID = 4, FIRST_CLICK = 8, USER = 16, HIST = 32, ITEM = 64, IMP_FIELDS = 128, REASON = 256, SAMPLE = 512;

    @Override
    public Event createInstance() {
        return new Event();
    }

    @Override
    public void serialize(Event e, DataOutputView out) throws IOException {
        int flags = (e.key != null ? KEY : 0) | (e.raw != null ? RAW : 0) | (e.impressionId != null ? IMPRESSION_ID : 0)
                | (e.firstClick ? FIRST_CLICK : 0) | (e.userCounts != null ? USER : 0) | (e.histItems != null ? HIST : 0)
                | (e.itemCounts != null ? ITEM : 0) | (e.kind == Event.IMPRESSION ? IMP_FIELDS : 0) | (e.reason != null ? REASON : 0)
                | (e.sample != null ? SAMPLE : 0);
        out.writeShort(flags);
        out.writeByte(e.kind);
        out.writeLong(e.ts);
        StateCodec.writeString(out, e.eventId);
        StateCodec.writeString(out, e.requestId);
        out.writeLong(e.userId);
        out.writeLong(e.itemId);
        out.writeLong(e.categoryId);
        if ((flags & IMP_FIELDS) != 0) {
            out.writeInt(e.position);
            StateCodec.writeString(out, e.device);
            out.writeInt(e.localHour);
            out.writeLong(e.advertiserId);
        }
        if ((flags & KEY) != 0) writeBytes(out, e.key);
        if ((flags & RAW) != 0) writeBytes(out, e.raw);
        if ((flags & IMPRESSION_ID) != 0) StateCodec.writeString(out, e.impressionId);
        if ((flags & USER) != 0) writeInts(out, e.userCounts);
        if ((flags & HIST) != 0) {
            StateCodec.writeLongs(out, e.histItems);
            StateCodec.writeLongs(out, e.histCategories);
        }
        if ((flags & ITEM) != 0) writeInts(out, e.itemCounts);
        if ((flags & REASON) != 0) StateCodec.writeString(out, e.reason);
        if ((flags & SAMPLE) != 0) writeBytes(out, e.sample);
    }

    @Override
    public Event deserialize(DataInputView in) throws IOException {
        Event e = new Event();
        int flags = in.readUnsignedShort();
        e.kind = in.readUnsignedByte();
        e.ts = in.readLong();
        e.eventId = StateCodec.readString(in);
        e.requestId = StateCodec.readString(in);
        e.userId = in.readLong();
        e.itemId = in.readLong();
        e.categoryId = in.readLong();
        if ((flags & IMP_FIELDS) != 0) {
            e.position = in.readInt();
            e.device = StateCodec.readString(in);
            e.localHour = in.readInt();
            e.advertiserId = in.readLong();
        }
        if ((flags & KEY) != 0) e.key = readBytes(in);
        if ((flags & RAW) != 0) e.raw = readBytes(in);
        if ((flags & IMPRESSION_ID) != 0) e.impressionId = StateCodec.readString(in);
        e.firstClick = (flags & FIRST_CLICK) != 0;
        if ((flags & USER) != 0) e.userCounts = readInts(in);
        if ((flags & HIST) != 0) {
            e.histItems = StateCodec.readLongs(in);
            e.histCategories = StateCodec.readLongs(in);
        }
        if ((flags & ITEM) != 0) e.itemCounts = readInts(in);
        if ((flags & REASON) != 0) e.reason = StateCodec.readString(in);
        if ((flags & SAMPLE) != 0) e.sample = readBytes(in);
        return e;
    }

    private static void writeBytes(DataOutputView out, byte[] b) throws IOException {
        out.writeInt(b.length);
        out.write(b);
    }

    private static byte[] readBytes(DataInputView in) throws IOException {
        byte[] b = new byte[in.readInt()];
        in.readFully(b);
        return b;
    }

    private static void writeInts(DataOutputView out, int[] v) throws IOException {
        out.writeByte(v.length);
        for (int x : v) out.writeInt(x);
    }

    private static int[] readInts(DataInputView in) throws IOException {
        int[] v = new int[in.readUnsignedByte()];
        for (int i = 0; i < v.length; i++) v[i] = in.readInt();
        return v;
    }

    @Override
    public TypeSerializerSnapshot<Event> snapshotConfiguration() {
        return new Snapshot();
    }

    /** Restores the serializer from a checkpoint. */
    public static final class Snapshot extends SimpleTypeSerializerSnapshot<Event> {
        public Snapshot() {
            super(EventSerializer::new);
        }
    }
}
