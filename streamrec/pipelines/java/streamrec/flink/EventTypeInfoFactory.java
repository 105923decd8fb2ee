package streamrec.flink;

import java.lang.reflect.Type;
import java.util.Map;

import org.apache.flink.api.common.serialization.SerializerConfig;
import org.apache.flink.api.common.typeinfo.TypeInfoFactory;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeutils.TypeSerializer;

/** Tells Flink to move {@link Event}s with {@link EventSerializer}. */
public final class EventTypeInfoFactory extends TypeInfoFactory<Event> {
    @Override
    public TypeInformation<Event> createTypeInfo(Type t, Map<String, TypeInformation<?>> genericParameters) {
        return INFO;
    }

    public static final TypeInformation<Event> INFO = new EventTypeInfo();

    /** Type information whose only job is to hand out the serializer. */
    public static final class EventTypeInfo extends TypeInformation<Event> {
        @Override public boolean isBasicType() { return false; }
        @Override public boolean isTupleType() { return false; }
        @Override public int getArity() { return 1; }
        @Override public int getTotalFields() { return 1; }
        @Override public Class<Event> getTypeClass() { return Event.class; }
        @Override public boolean isKeyType() { return false; }
        @Override public TypeSerializer<Event> createSerializer(SerializerConfig config) { return new EventSerializer(); }
        @Override public String toString() { return "Event"; }
        @Override public boolean equals(Object o) { return o instanceof EventTypeInfo; }
        @Override public int hashCode() { return EventTypeInfo.class.hashCode(); }
        @Override public boolean canEqual(Object o) { return o instanceof EventTypeInfo; }
    }
}
