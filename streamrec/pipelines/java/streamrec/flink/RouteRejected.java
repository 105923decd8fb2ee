package streamrec.flink;

import org.apache.flink.streaming.api.functions.ProcessFunction;
import org.apache.flink.util.Collector;

/** Right after the source: rejected events to the DLQ side output, valid ones on. */
public final class RouteRejected extends ProcessFunction<Event, Event> {
    private static final long serialVersionUID = 1L;

    @Override
    public void processElement(Event e, Context ctx, Collector<Event> out) {
        if (e.reason != null) {
            ctx.output(Dlq.TAG, Dlq.record(e.key, e.raw, e.reason));
        } else {
            out.collect(e);
        }
    }
}
