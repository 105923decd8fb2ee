package streamrec.flink;

import java.io.Serializable;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.DeserializationFeature;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;

/**
 * Parses and validates one raw event in a single pass: an {@link Event}, or null and the
 * reason it is rejected ({@link #reason()}).
 *
 * <p>The rules are not written here: the field list comes from pipelines/events.py
 * (validation_spec.validation_spec()), and the checks run in the order of
 * events.validate_event, so both give the same reason code for every input
 * (tests/test_validation_spec.py). Not thread-safe: one per source reader.
 */
public final class EventParser implements Serializable {
    private static final long serialVersionUID = 1L;
    private static final ObjectMapper JSON = new ObjectMapper().enable(DeserializationFeature.FAIL_ON_TRAILING_TOKENS);

    private final String spec;
    private final long maxFutureSkewMs;
    private transient Map<String, List<String[]>> groups; // group -> [name, kind(s|i|o), positive(+|-)]
    private transient String reason;

    public EventParser(String spec, long maxFutureSkewMs) {
        this.spec = spec;
        this.maxFutureSkewMs = maxFutureSkewMs;
    }

    /** Why the last {@link #parse} returned null. */
    public String reason() {
        return reason;
    }

    /** The reason {@code payload} is rejected, or null if it is a valid event (for tests). */
    public String check(byte[] payload, long arrivalMs) {
        return parse(payload, arrivalMs) == null ? reason : null;
    }

    public Event parse(byte[] payload, long arrivalMs) {
        if (groups == null) {
            groups = parseSpec(spec);
        }
        reason = null;
        JsonNode event;
        try {
            event = payload == null || payload.length == 0 ? null : JSON.readTree(payload);
        } catch (Exception e) {
            event = null;
        }
        if (event == null || event.isMissingNode()) {
            return rejected("malformed_json");
        }
        if (!event.isObject()) {
            return rejected("not_an_object");
        }
        JsonNode type = event.get("type");
        if (type == null || !type.isTextual() || !groups.containsKey(type.asText())) {
            return rejected("unknown_type");
        }
        boolean impression = type.asText().equals("impression");
        String why = check(event, type.asText(), "");
        if (why == null && impression) {
            why = check(event.get("context"), "context", "context.");
            if (why == null) why = check(event.get("item"), "item", "item.");
            if (why == null) {
                long hour = event.get("context").get("local_hour").asLong();
                if (hour < 0 || hour > 23) why = "invalid_value:context.local_hour";
            }
        }
        if (why == null && event.get("ts").asLong() > arrivalMs + maxFutureSkewMs) {
            why = "future_timestamp";
        }
        if (why != null) {
            return rejected(why);
        }
        Event e = new Event();
        e.kind = impression ? Event.IMPRESSION : Event.CLICK;
        e.ts = event.get("ts").asLong();
        e.eventId = event.get("event_id").asText();
        e.requestId = event.get("request_id").asText();
        e.userId = event.get("user_id").asLong();
        e.itemId = event.get("item_id").asLong();
        if (impression) {
            e.position = event.get("position").asInt();
            e.device = event.get("context").get("device").asText();
            e.localHour = event.get("context").get("local_hour").asInt();
            e.categoryId = event.get("item").get("category_id").asLong();
            e.advertiserId = event.get("item").get("advertiser_id").asLong();
        }
        return e;
    }

    private Event rejected(String why) {
        reason = why;
        return null;
    }

    private String check(JsonNode obj, String group, String prefix) {
        for (String[] field : groups.get(group)) { // the reason's text is built only for a rejected event
            JsonNode value = obj.get(field[0]);
            if (value == null || value.isNull()) return "missing_field:" + prefix + field[0];
            switch (field[1]) {
                case "i":
                    if (!value.isIntegralNumber() || !value.canConvertToLong()) return "wrong_type:" + prefix + field[0];
                    if (field[2].equals("+") && value.asLong() <= 0) return "invalid_value:" + prefix + field[0];
                    break;
                case "s":
                    if (!value.isTextual()) return "wrong_type:" + prefix + field[0];
                    if (value.asText().isEmpty()) return "invalid_value:" + prefix + field[0];
                    break;
                default:
                    if (!value.isObject()) return "wrong_type:" + prefix + field[0];
            }
        }
        return null;
    }

    /** "impression=event_id:s-,ts:i+,...;context=device:s-,..." */
    private static Map<String, List<String[]>> parseSpec(String spec) {
        Map<String, List<String[]>> out = new LinkedHashMap<>();
        for (String group : spec.split(";")) {
            String[] kv = group.split("=", 2);
            List<String[]> fields = new ArrayList<>();
            for (String field : kv[1].split(",")) {
                String[] nk = field.split(":", 2);
                fields.add(new String[] {nk[0], nk[1].substring(0, 1), nk[1].substring(1)});
            }
            out.put(kv[0], fields);
        }
        return out;
    }
}
