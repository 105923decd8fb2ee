package streamrec.flink;

import org.apache.flink.api.common.typeinfo.TypeInfo;

/**
 * One valid raw event on its way through the job's stages, with the features the stages
 * have attached so far (null until the stage that computes them has run).
 *
 * <p>Plain public fields and a hand-written serializer ({@link EventSerializer}): the
 * record crosses three network hops and waits in each stage's event-time buffer, and
 * Flink's POJO/Kryo serializers cost several times more per record.
 */
@TypeInfo(EventTypeInfoFactory.class)
public final class Event {
    public static final int IMPRESSION = 0;
    public static final int CLICK = 1;
    /** Made up by the category stage: the attribution window of impression {@code eventId} closes at ts. */
    public static final int LABEL_DEADLINE = 2;
    /** Made up by the user stage when a click arrives that joins an impression it has applied:
     *  the label of impression {@code impressionId} (category {@code categoryId}), sent ahead of
     *  the watermark. Later stages handle it at once; it never enters an event-time buffer. */
    public static final int EARLY_LABEL = 3;

    public byte[] key; // the Kafka key it came with (clicks keep it for the DLQ)
    public byte[] raw; // the raw payload; kept for clicks only (an orphan click goes to the DLQ unchanged)
    public String reason; // non-null: rejected by the parser (ts is then its arrival time; it never moves the watermark)

    public int kind;
    public long ts;
    public String eventId;
    public String requestId;
    public long userId;
    public long itemId;
    // impressions only (a joined click gets its impression's category_id)
    public int position;
    public String device;
    public int localHour;
    public long categoryId;
    public long advertiserId;

    // set by the user stage
    public String impressionId; // a joined click: the event id of the impression it labels
    public boolean firstClick; // a joined click: the first to join its impression (carries the label)
    public int[] userCounts;
    public long[] histItems;
    public long[] histCategories;
    // set by the item stage (impressions)
    public int[] itemCounts;
    // set by the category stage on its label deadlines: the sample waiting for its label (null once labelled or moved to the backend)
    public byte[] sample;

    public Event() {}

    /** Order inside one millisecond: impressions, clicks, deadlines, then by event id. */
    static int compareInTime(Event a, Event b) {
        int c = Long.compare(a.ts, b.ts);
        if (c != 0) return c;
        c = Integer.compare(a.kind, b.kind);
        return c != 0 ? c : a.eventId.compareTo(b.eventId);
    }
}
