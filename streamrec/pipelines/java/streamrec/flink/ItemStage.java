package streamrec.flink;


/** Item counters (keyed by item_id): an impression gets its item's counts; everything moves on. */
public final class ItemStage extends CounterStage<Event> {
    private static final long serialVersionUID = 1L;

    public ItemStage(long[] windowsMs) {
        super(windowsMs);
    }

    @Override
    protected long keyOf(Event e) {
        return e.itemId;
    }

    /** Early labels go on to the label join at once. */
    @Override
    protected void early(Event e) {
        emit(e, e.ts);
    }

    @Override
    protected void apply(WindowCounter counter, Event e) {
        if (e.kind == Event.IMPRESSION) {
            e.itemCounts = counter.counts(e.ts, windowsMs);
        }
        counter.add(e.kind, e.ts, maxWindowMs);
        emit(e, e.ts);
    }
}
