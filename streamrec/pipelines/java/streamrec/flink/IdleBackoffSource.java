package streamrec.flink;

import java.lang.reflect.Field;
import java.lang.reflect.InvocationHandler;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.lang.reflect.Proxy;
import java.time.Duration;
import java.util.function.Supplier;

import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.connector.source.Boundedness;
import org.apache.flink.api.connector.source.Source;
import org.apache.flink.api.connector.source.SourceReader;
import org.apache.flink.api.connector.source.SourceReaderContext;
import org.apache.flink.api.connector.source.SplitEnumerator;
import org.apache.flink.api.connector.source.SplitEnumeratorContext;
import org.apache.flink.api.java.typeutils.ResultTypeQueryable;
import org.apache.flink.connector.base.source.reader.SourceReaderBase;
import org.apache.flink.connector.base.source.reader.fetcher.SplitFetcherManager;
import org.apache.flink.connector.base.source.reader.splitreader.SplitReader;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.enumerator.KafkaSourceEnumState;
import org.apache.flink.connector.kafka.source.reader.KafkaPartitionSplitReader;
import org.apache.flink.connector.kafka.source.split.KafkaPartitionSplit;
import org.apache.flink.core.io.SimpleVersionedSerializer;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.internals.ConsumerDelegate;
import org.apache.kafka.common.errors.InterruptException;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * A KafkaSource whose consumers sleep {@code backoffMs} after an empty poll instead of
 * sending the next fetch at once.
 *
 * <p>Why: Flink's split reader calls {@code KafkaConsumer.poll(10 s)}, and inside it the
 * consumer sends fetch after fetch until records come. A Kafka broker holds an empty fetch
 * for {@code fetch.max.wait.ms} (500 ms), so that loop idles; the embedded broker (noida)
 * answers at once, so each caught-up fetcher thread spun a core, and the broker another
 * answering it: ~0.9 core in the demo's live mode, and in a long-running job the fetchers
 * spin even while the tasks work through what they fetched (noida returns a partition's
 * whole tail in one answer). Neither the Kafka client nor the connector has a setting for
 * it, so the consumer's poll is wrapped: non-blocking polls, and a sleep after an empty one.
 * Cost: up to {@code backoffMs} more latency when the input was idle; none under load.
 *
 * <p>How: the wrapped source's reader is the connector's own; only its split-reader factory
 * is decorated, and each new reader's consumer gets a poll that backs off (the consumer's
 * internal delegate is proxied). This reaches into private fields of the pinned connector
 * (4.0.1-2.0) and client (3.9.1) versions (pipelines/flink_jars.py pins their hashes); if
 * they ever change shape, the source logs a warning and works as the plain KafkaSource.
 */
public final class IdleBackoffSource<T> implements Source<T, KafkaPartitionSplit, KafkaSourceEnumState>, ResultTypeQueryable<T> {
    private static final long serialVersionUID = 1L;
    private static final Logger LOG = LoggerFactory.getLogger(IdleBackoffSource.class);

    private final KafkaSource<T> kafka;
    private final long backoffMs;

    public IdleBackoffSource(KafkaSource<T> kafka, long backoffMs) {
        this.kafka = kafka;
        this.backoffMs = backoffMs;
    }

    @Override
    public SourceReader<T, KafkaPartitionSplit> createReader(SourceReaderContext context) throws Exception {
        SourceReader<T, KafkaPartitionSplit> reader = kafka.createReader(context);
        try {
            decorateSplitReaders(reader, backoffMs);
        } catch (ReflectiveOperationException | RuntimeException e) {
            LOG.warn("cannot add the idle back-off to the Kafka source's consumers ({}): they poll as usual", e.toString());
        }
        return reader;
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    private static void decorateSplitReaders(SourceReader<?, ?> reader, long backoffMs) throws ReflectiveOperationException {
        SplitFetcherManager<?, ?> fetchers = (SplitFetcherManager<?, ?>) field(SourceReaderBase.class, "splitFetcherManager").get(reader);
        Field factoryField = field(SplitFetcherManager.class, "splitReaderFactory");
        Supplier<SplitReader> plain = (Supplier<SplitReader>) factoryField.get(fetchers);
        Field consumerField = field(KafkaPartitionSplitReader.class, "consumer");
        Field delegateField = field(KafkaConsumer.class, "delegate");
        Supplier<SplitReader> backingOff = () -> {
            SplitReader split = plain.get();
            try {
                KafkaConsumer<?, ?> consumer = (KafkaConsumer<?, ?>) consumerField.get(split);
                ConsumerDelegate<?, ?> inner = (ConsumerDelegate<?, ?>) delegateField.get(consumer);
                delegateField.set(consumer, Proxy.newProxyInstance(ConsumerDelegate.class.getClassLoader(),
                        new Class<?>[] {ConsumerDelegate.class}, new BackoffPoll(inner, backoffMs)));
            } catch (ReflectiveOperationException | RuntimeException e) {
                LOG.warn("cannot add the idle back-off to a Kafka consumer ({}): it polls as usual", e.toString());
            }
            return split;
        };
        factoryField.set(fetchers, backingOff);
    }

    private static Field field(Class<?> owner, String name) throws NoSuchFieldException {
        Field f = owner.getDeclaredField(name);
        f.setAccessible(true);
        return f;
    }

    /** {@code poll(timeout)} as non-blocking polls with a sleep after each empty one; all else passes through. */
    private static final class BackoffPoll implements InvocationHandler {
        private final Object inner;
        private final long backoffMs;

        BackoffPoll(Object inner, long backoffMs) {
            this.inner = inner;
            this.backoffMs = backoffMs;
        }

        @Override
        public Object invoke(Object proxy, Method method, Object[] args) throws Throwable {
            if (method.getName().equals("poll") && args != null && args.length == 1 && args[0] instanceof Duration) {
                return poll((Duration) args[0]);
            }
            try {
                return method.invoke(inner, args);
            } catch (InvocationTargetException e) {
                throw e.getCause();
            }
        }

        private ConsumerRecords<?, ?> poll(Duration timeout) {
            long deadline = System.nanoTime() + timeout.toNanos();
            while (true) {
                // wakeup() (split changes, shutdown) makes this throw WakeupException, as the plain poll would
                ConsumerRecords<?, ?> records = ((ConsumerDelegate<?, ?>) inner).poll(Duration.ZERO);
                long left = deadline - System.nanoTime();
                if (!records.isEmpty() || left <= 0) {
                    return records;
                }
                try {
                    Thread.sleep(Math.min(backoffMs, Math.max(1, left / 1_000_000)));
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                    throw new InterruptException(e);
                }
            }
        }
    }

    @Override
    public Boundedness getBoundedness() {
        return kafka.getBoundedness();
    }

    @Override
    public SplitEnumerator<KafkaPartitionSplit, KafkaSourceEnumState> createEnumerator(
            SplitEnumeratorContext<KafkaPartitionSplit> context) {
        return kafka.createEnumerator(context);
    }

    @Override
    public SplitEnumerator<KafkaPartitionSplit, KafkaSourceEnumState> restoreEnumerator(
            SplitEnumeratorContext<KafkaPartitionSplit> context, KafkaSourceEnumState state) throws Exception {
        return kafka.restoreEnumerator(context, state);
    }

    @Override
    public SimpleVersionedSerializer<KafkaPartitionSplit> getSplitSerializer() {
        return kafka.getSplitSerializer();
    }

    @Override
    public SimpleVersionedSerializer<KafkaSourceEnumState> getEnumeratorCheckpointSerializer() {
        return kafka.getEnumeratorCheckpointSerializer();
    }

    @Override
    public TypeInformation<T> getProducedType() {
        return kafka.getProducedType();
    }
}
