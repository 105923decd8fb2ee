"""The raw-event contract as a Flink SQL expression, generated from ``pipelines/events.py``.

The Flink job validates events in the JVM (DESIGN.md: per-event work in SQL, not Python).
Writing that SQL by hand would create a second validator that drifts from the first, so
this module generates it from the same field specs that ``validate_event`` uses, and the
tests check that both give the same reason code for every event the generator can make.

Flink 2.3 facts this relies on (checked in tests/test_validation_sql.py):
- ``JSON_QUERY(p, path WITH CONDITIONAL ARRAY WRAPPER)`` is NULL when the field is missing
  or JSON null, else the field's JSON text in ``[...]`` (arrays stay as they are);
- ``JSON_VALUE`` is NULL for arrays and objects, text for scalars; ``JSON_QUERY`` without
  a wrapper is NULL for scalars;
- ``TRY_CAST('1.5' AS BIGINT)`` is 1, so integers are recognised by a regex on the JSON
  text, never by a cast.
"""

from __future__ import annotations

from pipelines import events as ev

_INT_JSON = r"^\[-?[0-9]+\]$"


def _path(field: str) -> str:
    return "$." + field


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _field_checks(payload: str, spec: dict[str, tuple[type, bool]], prefix: str) -> list[tuple[str, str]]:
    """(condition, reason) pairs in the same order as ``events._check_fields``."""
    checks = []
    for name, (kind, positive) in spec.items():
        full = prefix + name
        value = f"JSON_VALUE({payload}, {_quote(_path(full))})"
        wrapped = f"JSON_QUERY({payload}, {_quote(_path(full))} WITH CONDITIONAL ARRAY WRAPPER)"
        checks.append((f"{wrapped} IS NULL", f"{ev.MISSING_FIELD}:{full}"))
        if kind is int:
            checks.append((f"{value} IS NULL OR NOT REGEXP({wrapped}, {_quote(_INT_JSON)})", f"{ev.WRONG_TYPE}:{full}"))
            if positive:
                checks.append((f"TRY_CAST({value} AS BIGINT) IS NULL OR TRY_CAST({value} AS BIGINT) <= 0",
                               f"{ev.INVALID_VALUE}:{full}"))
        elif kind is str:
            checks.append((f"{value} IS NULL OR {wrapped} NOT LIKE '[\"%'", f"{ev.WRONG_TYPE}:{full}"))
            checks.append((f"{value} = ''", f"{ev.INVALID_VALUE}:{full}"))
        elif kind is dict:
            # JSON_QUERY without a wrapper is NULL for scalars: COALESCE makes that a mismatch
            checks.append((f"COALESCE(JSON_QUERY({payload}, {_quote(_path(full))}), '') NOT LIKE '{{%'", f"{ev.WRONG_TYPE}:{full}"))
    return checks


def _case(checks: list[tuple[str, str]]) -> str:
    whens = "\n    ".join(f"WHEN {cond} THEN {_quote(reason)}" for cond, reason in checks)
    return f"CASE\n    {whens}\n    ELSE CAST(NULL AS STRING) END"


def reason_expression(payload: str = "payload", arrival_ms: str = "arrival_ms") -> str:
    """SQL for the rejection reason of a raw event (NULL when valid).

    ``arrival_ms`` is the column with the event's arrival time in epoch ms (the Kafka
    record timestamp in the job); timestamps more than ``MAX_FUTURE_SKEW_MS`` after it are
    far-future. Reasons are the codes of pipelines/events.py with ``:field`` where the
    Python validator names a field (it adds free-text detail that the SQL omits).
    """
    kind = f"JSON_VALUE({payload}, '$.type')"
    ts = f"TRY_CAST(JSON_VALUE({payload}, '$.ts') AS BIGINT)"
    future = (f"{ts} > {arrival_ms} + {ev.MAX_FUTURE_SKEW_MS}", ev.FUTURE_TIMESTAMP)
    hour = f"TRY_CAST(JSON_VALUE({payload}, '$.context.local_hour') AS BIGINT)"
    impression = (
        _field_checks(payload, ev.IMPRESSION_FIELDS, "")
        + _field_checks(payload, ev.CONTEXT_FIELDS, "context.")
        + _field_checks(payload, ev.ITEM_FIELDS, "item.")
        + [(f"{hour} < 0 OR {hour} > 23", f"{ev.INVALID_VALUE}:context.local_hour"), future]
    )
    click = _field_checks(payload, ev.CLICK_FIELDS, "") + [future]
    types = ", ".join(_quote(t) for t in ev.EVENT_TYPES)
    return (
        f"CASE\n  WHEN NOT ({payload} IS JSON) THEN {_quote(ev.MALFORMED_JSON)}\n"
        f"  WHEN NOT ({payload} IS JSON OBJECT) THEN {_quote(ev.NOT_AN_OBJECT)}\n"
        f"  WHEN {kind} IS NULL OR {kind} NOT IN ({types}) THEN {_quote(ev.UNKNOWN_TYPE)}\n"
        f"  WHEN {kind} = 'impression' THEN {_case(impression)}\n"
        f"  ELSE {_case(click)}\nEND"
    )


def reason_key(reason: str) -> str:
    """The comparable part of a reason: the code and the field, without free-text detail
    (``invalid_value:user_id=-3 must be > 0`` -> ``invalid_value:user_id``)."""
    code, _, rest = reason.partition(":")
    if code in (ev.MISSING_FIELD, ev.WRONG_TYPE, ev.INVALID_VALUE):
        field = rest.strip().split("=")[0].split(" ")[0]
        return f"{code}:{field}"
    return code
