"""The raw-event contract as the Flink job checks it, generated from ``events.py``.

The job validates events in the JVM, in its source readers (pipelines/java/.../EventParser),
parsing each event once. Its rules are not written in Java: the field list is this module's
literal, made from the same field specs ``validate_event`` uses, and the parser applies the
checks in ``validate_event``'s order, so the two give the same reason code.
tests/test_validation_spec.py checks that on every kind of event the generator can make
plus hand-made edge cases.
"""

from __future__ import annotations

from streamrec.contracts import events as ev

_KIND = {int: "i", str: "s", dict: "o"}


def validation_spec() -> str:
    """``impression=event_id:s-,ts:i+,...;click=...;context=...;item=...`` for EventParser."""
    groups = {**ev.EVENT_TYPES, "context": ev.CONTEXT_FIELDS, "item": ev.ITEM_FIELDS}
    return ";".join(
        f"{group}=" + ",".join(f"{name}:{_KIND[kind]}{'+' if positive else '-'}" for name, (kind, positive) in fields.items())
        for group, fields in groups.items()
    )


def reason_key(reason: str) -> str:
    """The comparable part of a reason: the code and the field, without free-text detail
    (``invalid_value:user_id=-3 must be > 0`` -> ``invalid_value:user_id``)."""
    code, _, rest = reason.partition(":")
    if code in (ev.MISSING_FIELD, ev.WRONG_TYPE, ev.INVALID_VALUE):
        field = rest.strip().split("=")[0].split(" ")[0]
        return f"{code}:{field}"
    return code
