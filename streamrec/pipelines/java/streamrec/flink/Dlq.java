package streamrec.flink;

import java.nio.charset.StandardCharsets;
import java.util.List;

import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.util.OutputTag;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.internals.RecordHeader;

/** The dead-letter queue's records: (Kafka key, payload unchanged, reason), and their Kafka form. */
public final class Dlq {
    static final byte[] EMPTY = new byte[0];
    public static final TypeInformation<Tuple3<byte[], byte[], String>> TYPE =
            Types.TUPLE(Types.PRIMITIVE_ARRAY(Types.BYTE), Types.PRIMITIVE_ARRAY(Types.BYTE), Types.STRING);
    public static final OutputTag<Tuple3<byte[], byte[], String>> TAG = new OutputTag<>("dlq", TYPE);

    private Dlq() {}

    static Tuple3<byte[], byte[], String> record(byte[] key, byte[] payload, String reason) {
        return Tuple3.of(key == null ? EMPTY : key, payload == null ? EMPTY : payload, reason);
    }

    /** To the DLQ topic: the original key and payload, the reason in the {@code reason} header. */
    public static final class Serializer implements KafkaRecordSerializationSchema<Tuple3<byte[], byte[], String>> {
        private static final long serialVersionUID = 1L;
        private final String topic;

        public Serializer(String topic) {
            this.topic = topic;
        }

        @Override
        public ProducerRecord<byte[], byte[]> serialize(Tuple3<byte[], byte[], String> r, KafkaSinkContext context, Long timestamp) {
            List<Header> headers = List.of(new RecordHeader("reason", r.f2.getBytes(StandardCharsets.UTF_8)));
            return new ProducerRecord<>(topic, null, null, r.f0.length == 0 ? null : r.f0, r.f1, headers);
        }
    }
}
