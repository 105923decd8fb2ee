package streamrec.flink;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.TimeUnit;

import org.apache.kafka.clients.admin.AbortTransactionSpec;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.DescribeProducersResult;
import org.apache.kafka.clients.admin.ListTransactionsOptions;
import org.apache.kafka.clients.admin.ProducerState;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.admin.TransactionListing;
import org.apache.kafka.clients.admin.TransactionState;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.TopicPartitionInfo;

/**
 * Finds and aborts hanging transactions on the job's output topics: a partition holding an
 * open transaction that its coordinator no longer has open. Kafka never completes one by
 * itself (the coordinator's timeout only covers transactions it knows), and read_committed
 * readers of that partition see nothing past its first record until it is aborted, which is
 * what Kafka's own `kafka-transactions.sh find-hanging` / `abort` do by hand.
 *
 * <p>Seen after kill -9s of a single broker under load: the job kept committing, yet a
 * partition's last stable offset stayed put. The coordinator is asked about the very producer
 * id and epoch first, so a transaction being written or committed is never touched.
 */
public final class HangingTransactions {
    private static final Set<TransactionState> OPEN =
            Set.of(TransactionState.ONGOING, TransactionState.PREPARE_COMMIT, TransactionState.PREPARE_ABORT);

    private HangingTransactions() {}

    /**
     * Abort the hanging transactions of {@code topics} whose last write is older than
     * {@code minAgeMs}; returns one line per aborted transaction (partition, producer, start).
     */
    public static List<String> abortHanging(String bootstrap, List<String> topics, long minAgeMs, int timeoutMs)
            throws Exception {
        Properties props = new Properties();
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, timeoutMs);
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, timeoutMs);
        List<String> aborted = new ArrayList<>();
        try (Admin admin = Admin.create(props)) {
            Map<TopicPartition, ProducerState> open = openOnPartitions(admin, topics, minAgeMs, timeoutMs);
            if (open.isEmpty()) {
                return aborted;
            }
            Set<Long> live = openAtCoordinators(admin, open, timeoutMs);
            for (Map.Entry<TopicPartition, ProducerState> e : open.entrySet()) {
                ProducerState s = e.getValue();
                if (live.contains(s.producerId())) {
                    continue;
                }
                admin.abortTransaction(new AbortTransactionSpec(e.getKey(), s.producerId(), (short) s.producerEpoch(),
                        s.coordinatorEpoch().orElse(-1))).all().get(timeoutMs, TimeUnit.MILLISECONDS);
                aborted.add(e.getKey() + " producer " + s.producerId() + " epoch " + s.producerEpoch()
                        + " from offset " + s.currentTransactionStartOffset().getAsLong());
            }
        }
        return aborted;
    }

    /** The open transactions (one per partition and producer) whose last write is older than minAgeMs. */
    private static Map<TopicPartition, ProducerState> openOnPartitions(Admin admin, List<String> topics, long minAgeMs,
                                                                       int timeoutMs) throws Exception {
        List<TopicPartition> partitions = new ArrayList<>();
        for (TopicDescription d : admin.describeTopics(topics).allTopicNames().get(timeoutMs, TimeUnit.MILLISECONDS).values()) {
            for (TopicPartitionInfo p : d.partitions()) {
                partitions.add(new TopicPartition(d.name(), p.partition()));
            }
        }
        Map<TopicPartition, ProducerState> open = new HashMap<>();
        long now = System.currentTimeMillis();
        Map<TopicPartition, DescribeProducersResult.PartitionProducerState> states =
                admin.describeProducers(partitions).all().get(timeoutMs, TimeUnit.MILLISECONDS);
        for (Map.Entry<TopicPartition, DescribeProducersResult.PartitionProducerState> e : states.entrySet()) {
            for (ProducerState s : e.getValue().activeProducers()) {
                if (s.currentTransactionStartOffset().isPresent() && now - s.lastTimestamp() >= minAgeMs) {
                    open.put(e.getKey(), s);
                }
            }
        }
        return open;
    }

    /** The producer ids among {@code open}'s whose coordinator has a transaction open. */
    private static Set<Long> openAtCoordinators(Admin admin, Map<TopicPartition, ProducerState> open, int timeoutMs)
            throws Exception {
        Set<Long> ids = new HashSet<>();
        for (ProducerState s : open.values()) {
            ids.add(s.producerId());
        }
        Set<Long> live = new HashSet<>();
        for (TransactionListing t : admin.listTransactions(new ListTransactionsOptions().filterProducerIds(ids))
                .all().get(timeoutMs, TimeUnit.MILLISECONDS)) {
            if (OPEN.contains(t.state())) {
                live.add(t.producerId());
            }
        }
        return live;
    }
}
