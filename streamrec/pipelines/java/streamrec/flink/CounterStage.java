package streamrec.flink;

import java.util.Arrays;

import org.apache.flink.api.common.typeutils.TypeSerializer;

/** A stage whose per-key state is one entity's {@link WindowCounter} (items, categories). */
public abstract class CounterStage<OUT> extends EventTimeStage<WindowCounter, OUT> {
    private static final long serialVersionUID = 1L;
    protected final long[] windowsMs;
    protected final long maxWindowMs;

    protected CounterStage(long[] windowsMs) {
        this.windowsMs = windowsMs;
        this.maxWindowMs = Arrays.stream(windowsMs).max().orElseThrow();
    }

    @Override
    protected TypeSerializer<WindowCounter> stateSerializer() {
        return new WindowCounter.Serializer();
    }

    @Override
    protected WindowCounter counterOf(WindowCounter state) {
        return state;
    }

    @Override
    protected WindowCounter newState() {
        return new WindowCounter();
    }
}
