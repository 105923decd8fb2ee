package streamrec.flink;

import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.consumer.ConsumerRecord;

/**
 * Kafka record to {@link Event}, in the source reader. A rejected event still comes out
 * (with its reason, key and payload, its arrival time as ts) so that it reaches the DLQ:
 * the job never fails and never drops input.
 */
public final class EventDeserializer implements KafkaRecordDeserializationSchema<Event> {
    private static final long serialVersionUID = 1L;
    private final EventParser parser;

    public EventDeserializer(EventParser parser) {
        this.parser = parser;
    }

    @Override
    public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Event> out) {
        Event e = parser.parse(record.value(), record.timestamp());
        if (e == null) {
            e = new Event();
            e.reason = parser.reason();
            e.raw = record.value() == null ? new byte[0] : record.value();
            e.ts = record.timestamp();
            e.eventId = "";
        } else {
            e.raw = record.value(); // until the user stage: a late event goes to the DLQ unchanged
        }
        e.key = record.key();
        out.collect(e);
    }

    @Override
    public TypeInformation<Event> getProducedType() {
        return EventTypeInfoFactory.INFO;
    }
}
