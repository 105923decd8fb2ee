"""The operator's view of a model store (`streamrec store ls|verify`): versions, chains,
checksums, LATEST, the pin and the writer lease, as plain data the CLI prints."""

from __future__ import annotations

import time
from typing import Any

from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.modelstore.lease import lease_records


def describe(store: ModelStore) -> dict[str, Any]:
    """Every version with its kind, parent, size and freshness; LATEST, pin and lease."""
    latest, latest_problem = store.resolve_latest()
    try:
        pin, pin_problem = store.pinned(), None
    except CorruptVersion as exc:
        pin, pin_problem = None, str(exc)
    leases = lease_records(store)
    now = time.time()
    versions = []
    for v in store.versions():
        try:
            m = store.manifest(v)
        except CorruptVersion as exc:
            versions.append({"version": v, "problem": str(exc)})
            continue
        versions.append({"version": v, "kind": m["kind"], "parent": m["parent"], "created_at": m.get("created_at"),
                         "trained_through_ms": m.get("trained_through_ms"), "shards": m.get("shards", 1),
                         "rows": sum(t["upserts"] + t["deleted"] for t in m["tables"].values()),
                         "bytes": sum(f["bytes"] for f in m["files"].values())})
    return {
        "model": store.model, "root": store.base, "latest": latest, "latest_problem": latest_problem,
        "pin": pin.__dict__ if pin else None, "pin_problem": pin_problem,
        "lease": ({**leases[-1].__dict__, "live": leases[-1].live(now)} if leases else None),
        "versions": versions,
    }


def verify(store: ModelStore, versions: list[int] | None = None) -> dict[str, Any]:
    """Check each version's files (sizes, checksums, Arrow, finite values) and the chain it
    needs; LATEST and the pin must name versions that load. ``ok`` is False on any problem."""
    described = describe(store)
    checked = versions if versions is not None else [v["version"] for v in described["versions"]]
    for name, target in (("LATEST", described["latest"]), ("PIN", (described["pin"] or {}).get("version"))):
        if target is not None and target not in checked:
            checked.append(target)
    own: dict[int, str | None] = {}  # each version's files, read once however many chains need them

    def files_problem(v: int) -> str | None:
        if v not in own:
            try:
                store.read_version(v)
                own[v] = None
            except CorruptVersion as exc:
                own[v] = str(exc)
        return own[v]

    problems: dict[str, list[str]] = {}
    for v in checked:
        try:
            chain = store.chain(v)
        except CorruptVersion as exc:
            problems[str(v)] = [str(exc)]
            continue
        found = [f"needs version {c}: {files_problem(c)}" if c != v else files_problem(c) for c in chain if files_problem(c)]
        if found:
            problems[str(v)] = found
    if described["latest_problem"]:
        problems["LATEST"] = [described["latest_problem"]]
    if described["pin_problem"]:
        problems["PIN"] = [described["pin_problem"]]
    return {"model": store.model, "root": store.base, "checked": len(checked), "ok": not problems, "problems": problems}
