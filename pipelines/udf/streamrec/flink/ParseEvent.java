package streamrec.flink;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.DeserializationFeature;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.functions.ScalarFunction;
import org.apache.flink.types.Row;

/**
 * Parses and validates one raw event in a single pass: the reason it is rejected (null if
 * valid) and its fields.
 *
 * <p>The rules are not written here: the field list comes in as a literal generated from
 * pipelines/events.py (validation_spec()), and the checks run in the order of
 * events.validate_event, so both give the same reason code for every input
 * (tests/test_validation.py). One JSON parse per event instead of one per JSON_VALUE call:
 * that was the job's bottleneck (measured in bench/RESULTS.md).
 */
public class ParseEvent extends ScalarFunction {
    private static final ObjectMapper JSON = new ObjectMapper().enable(DeserializationFeature.FAIL_ON_TRAILING_TOKENS);

    private transient String parsedSpec;
    private transient Map<String, List<String[]>> groups; // group -> [name, kind(s|i|o), positive(+|-)]

    @Override
    public boolean isDeterministic() {
        return false; // keeps the planner from copying the call into every field access
    }

    public @DataTypeHint("ROW<reason STRING, kind INT, ts BIGINT, event_id STRING, request_id STRING, user_id BIGINT,"
            + " item_id BIGINT, `position` INT, device STRING, local_hour INT, category_id BIGINT, advertiser_id BIGINT>")
    Row eval(byte[] payload, Long arrivalMs, Long maxFutureSkewMs, String spec) {
        if (!spec.equals(parsedSpec)) {
            groups = parseSpec(spec);
            parsedSpec = spec;
        }
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
        String reason = check(event, type.asText(), "");
        if (reason == null && impression) {
            reason = check(event.get("context"), "context", "context.");
            if (reason == null) reason = check(event.get("item"), "item", "item.");
            if (reason == null) {
                long hour = event.get("context").get("local_hour").asLong();
                if (hour < 0 || hour > 23) reason = "invalid_value:context.local_hour";
            }
        }
        if (reason == null && event.get("ts").asLong() > arrivalMs + maxFutureSkewMs) {
            reason = "future_timestamp";
        }
        if (reason != null) {
            return rejected(reason);
        }
        Row row = new Row(12); // field order of the ROW type above
        row.setField(1, impression ? 0 : 1);
        row.setField(2, event.get("ts").asLong());
        row.setField(3, event.get("event_id").asText());
        row.setField(4, event.get("request_id").asText());
        row.setField(5, event.get("user_id").asLong());
        row.setField(6, event.get("item_id").asLong());
        if (impression) {
            row.setField(7, event.get("position").asInt());
            row.setField(8, event.get("context").get("device").asText());
            row.setField(9, event.get("context").get("local_hour").asInt());
            row.setField(10, event.get("item").get("category_id").asLong());
            row.setField(11, event.get("item").get("advertiser_id").asLong());
        }
        return row;
    }

    private String check(JsonNode obj, String group, String prefix) {
        for (String[] field : groups.get(group)) {
            String name = prefix + field[0];
            JsonNode value = obj.get(field[0]);
            if (value == null || value.isNull()) return "missing_field:" + name;
            switch (field[1]) {
                case "i":
                    if (!value.isIntegralNumber() || !value.canConvertToLong()) return "wrong_type:" + name;
                    if (field[2].equals("+") && value.asLong() <= 0) return "invalid_value:" + name;
                    break;
                case "s":
                    if (!value.isTextual()) return "wrong_type:" + name;
                    if (value.asText().isEmpty()) return "invalid_value:" + name;
                    break;
                default:
                    if (!value.isObject()) return "wrong_type:" + name;
            }
        }
        return null;
    }

    private static Row rejected(String reason) {
        Row row = new Row(12);
        row.setField(0, reason);
        return row;
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
