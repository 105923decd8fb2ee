package streamrec.flink;

import java.io.IOException;
import java.io.Serializable;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.core.JsonFactory;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.core.JsonParseException;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.core.JsonParser;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.core.JsonToken;

/**
 * Parses and validates one raw event in a single pass: an {@link Event}, or null and the
 * reason it is rejected ({@link #reason()}).
 *
 * <p>The rules are not written here: the field list comes from pipelines/events.py
 * (validation_spec.validation_spec()), and the checks run in the order of
 * events.validate_event, so both give the same reason code for every input
 * (tests/test_validation_spec.py). Not thread-safe: one per source reader.
 *
 * <p>Reads Jackson's token stream straight into one slot per known field instead of
 * building a tree: the tree's maps and nodes were a tenth of the job's CPU. Unknown fields
 * are skipped (still checked for syntax); a repeated field keeps its last value, as a
 * JSON object read into a map (Python's json, orjson, Jackson's tree) does.
 */
public final class EventParser implements Serializable {
    private static final long serialVersionUID = 1L;
    private static final JsonFactory JSON = new JsonFactory();
    private static final String TYPE = "type";

    private final String spec;
    private final long maxFutureSkewMs;
    private transient Map<String, Field[]> types; // event type -> its fields, in check order
    private transient Slots top; // the event's own fields (of every type) and its type
    private transient Map<String, Slots> nested; // an object-valued field -> the slots of its fields
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
        if (types == null) {
            compile(spec);
        }
        reason = null;
        boolean object;
        try {
            if (payload == null || payload.length == 0) {
                return rejected("malformed_json");
            }
            object = read(payload);
        } catch (IOException e) {
            return rejected("malformed_json");
        }
        if (!object) {
            return rejected("not_an_object");
        }
        String type = top.kind(TYPE) == Slots.STRING ? top.text(TYPE) : null;
        Field[] fields = type == null ? null : types.get(type);
        if (fields == null) {
            return rejected("unknown_type");
        }
        boolean impression = type.equals("impression");
        String why = check(top, fields, "");
        if (why == null && impression) {
            Slots context = nested.get("context"), item = nested.get("item");
            why = check(context, context.fields, "context.");
            if (why == null) why = check(item, item.fields, "item.");
            if (why == null) {
                long hour = context.number("local_hour");
                if (hour < 0 || hour > 23) why = "invalid_value:context.local_hour";
            }
        }
        if (why == null && top.number("ts") > arrivalMs + maxFutureSkewMs) {
            why = "future_timestamp";
        }
        if (why != null) {
            return rejected(why);
        }
        Event e = new Event();
        e.kind = impression ? Event.IMPRESSION : Event.CLICK;
        e.ts = top.number("ts");
        e.eventId = top.text("event_id");
        e.requestId = top.text("request_id");
        e.userId = top.number("user_id");
        e.itemId = top.number("item_id");
        if (impression) {
            Slots context = nested.get("context"), item = nested.get("item");
            e.position = (int) top.number("position");
            e.device = context.text("device");
            e.localHour = (int) context.number("local_hour");
            e.categoryId = item.number("category_id");
            e.advertiserId = item.number("advertiser_id");
        }
        return e;
    }

    private Event rejected(String why) {
        reason = why;
        return null;
    }

    /** Fills the slots; false if the payload is valid JSON but not an object. */
    private boolean read(byte[] payload) throws IOException {
        try (JsonParser p = JSON.createParser(payload)) {
            JsonToken first = p.nextToken();
            if (first == null) {
                throw new JsonParseException(p, "no JSON value");
            }
            boolean object = first == JsonToken.START_OBJECT;
            if (object) {
                readObject(p, top, true);
            } else {
                p.skipChildren();
            }
            if (p.nextToken() != null) {
                throw new JsonParseException(p, "trailing tokens after the JSON value");
            }
            return object;
        }
    }

    /** Reads the object whose START_OBJECT {@code p} is on, up to its END_OBJECT. */
    private void readObject(JsonParser p, Slots slots, boolean root) throws IOException {
        slots.clear();
        while (p.nextToken() == JsonToken.FIELD_NAME) {
            String name = p.currentName();
            JsonToken value = p.nextToken();
            int slot = slots.slot(name);
            Slots inner = root && value == JsonToken.START_OBJECT ? nested.get(name) : null;
            if (inner != null) {
                readObject(p, inner, false);
            } else {
                p.skipChildren(); // a no-op on a scalar
            }
            if (slot >= 0) {
                slots.set(slot, value, p);
            }
        }
    }

    private static String check(Slots slots, Field[] fields, String prefix) {
        for (Field field : fields) { // the reason's text is built only for a rejected event
            int slot = slots.slot(field.name);
            byte kind = slots.kind[slot];
            if (kind == Slots.ABSENT || kind == Slots.NULL) return "missing_field:" + prefix + field.name;
            switch (field.kind) {
                case 'i':
                    if (kind != Slots.INTEGER) return "wrong_type:" + prefix + field.name;
                    if (field.positive && slots.number[slot] <= 0) return "invalid_value:" + prefix + field.name;
                    break;
                case 's':
                    if (kind != Slots.STRING) return "wrong_type:" + prefix + field.name;
                    if (slots.text[slot].isEmpty()) return "invalid_value:" + prefix + field.name;
                    break;
                default:
                    if (kind != Slots.OBJECT) return "wrong_type:" + prefix + field.name;
            }
        }
        return null;
    }

    /** "impression=event_id:s-,ts:i+,...;context=device:s-,..." */
    private void compile(String text) {
        Map<String, Field[]> groups = new LinkedHashMap<>();
        for (String group : text.split(";")) {
            String[] kv = group.split("=", 2);
            List<Field> fields = new ArrayList<>();
            for (String field : kv[1].split(",")) {
                String[] nk = field.split(":", 2);
                fields.add(new Field(nk[0], nk[1].charAt(0), nk[1].charAt(1) == '+'));
            }
            groups.put(kv[0], fields.toArray(new Field[0]));
        }
        // a group some field refers to as its object value is that object's fields; the others are event types
        Map<String, Slots> objects = new HashMap<>();
        List<String> topNames = new ArrayList<>(List.of(TYPE));
        for (Field[] fields : groups.values()) {
            for (Field f : fields) {
                if (f.kind == 'o' && groups.containsKey(f.name)) {
                    objects.put(f.name, new Slots(groups.get(f.name)));
                }
            }
        }
        Map<String, Field[]> eventTypes = new LinkedHashMap<>();
        for (Map.Entry<String, Field[]> g : groups.entrySet()) {
            if (!objects.containsKey(g.getKey())) {
                eventTypes.put(g.getKey(), g.getValue());
                for (Field f : g.getValue()) topNames.add(f.name);
            }
        }
        types = eventTypes;
        nested = objects;
        top = new Slots(topNames.stream().distinct().map(n -> new Field(n, 'x', false)).toArray(Field[]::new));
    }

    /** One field of the spec: its name, kind ('i' integer, 's' string, 'o' object) and whether it must be > 0. */
    private static final class Field {
        final String name;
        final char kind;
        final boolean positive;

        Field(String name, char kind, boolean positive) {
            this.name = name;
            this.kind = kind;
            this.positive = positive;
        }
    }

    /** The values of one JSON object's known fields, one slot per field name. */
    private static final class Slots {
        static final byte ABSENT = 0, NULL = 1, INTEGER = 2, STRING = 3, OBJECT = 4, OTHER = 5; // OTHER: big/float number, bool, array

        final Field[] fields;
        final Map<String, Integer> index = new HashMap<>();
        final byte[] kind;
        final long[] number;
        final String[] text;

        Slots(Field[] fields) {
            this.fields = fields;
            for (int i = 0; i < fields.length; i++) index.put(fields[i].name, i);
            kind = new byte[fields.length];
            number = new long[fields.length];
            text = new String[fields.length];
        }

        void clear() {
            Arrays.fill(kind, ABSENT);
        }

        int slot(String name) {
            Integer i = index.get(name);
            return i == null ? -1 : i;
        }

        /** Records the value {@code p} has just read (its first token {@code first}). */
        void set(int slot, JsonToken first, JsonParser p) throws IOException {
            switch (first) {
                case VALUE_NULL:
                    kind[slot] = NULL;
                    break;
                case VALUE_STRING:
                    kind[slot] = STRING;
                    text[slot] = p.getText();
                    break;
                case VALUE_NUMBER_INT:
                    if (p.getNumberType() == JsonParser.NumberType.BIG_INTEGER) {
                        kind[slot] = OTHER; // beyond 64 bits: no id or timestamp
                    } else {
                        kind[slot] = INTEGER;
                        number[slot] = p.getLongValue();
                    }
                    break;
                case START_OBJECT: // p is on its END_OBJECT now
                    kind[slot] = OBJECT;
                    break;
                default:
                    kind[slot] = OTHER;
            }
        }

        byte kind(String name) {
            return kind[slot(name)];
        }

        long number(String name) {
            return number[slot(name)];
        }

        String text(String name) {
            return text[slot(name)];
        }
    }
}
