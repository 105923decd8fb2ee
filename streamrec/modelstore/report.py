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
            if store.has_version(v):  # else deleted since it was listed (retention): not a problem
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
    needs, as a node loading it would read them; LATEST and the pin must name versions that
    load (``versions``: check those alone). ``ok`` is False on any problem. On a live store, retention and compaction delete
    versions while this runs: a version there at the start and gone at the end is no problem
    (listed in ``deleted_during_check``), and a chain is walked again when a version it
    needed went (it starts at a newer image now)."""
    described = describe(store)
    present = [v["version"] for v in described["versions"]]
    pinned = (described["pin"] or {}).get("version")
    # asked for some versions: those alone (LATEST's and the pin's own problems are still said)
    targets = list(dict.fromkeys(versions)) if versions is not None else list(present)
    if versions is None:
        targets += [v for v in (described["latest"], pinned) if v is not None and v not in targets]
    files = _FileChecks(store)
    problems: dict[str, list[str]] = {}
    checked, gone = [], []
    for v in targets:
        found = _problems(store, v, files, v in present)
        if found is None:
            gone.append(v)
            continue
        checked.append(v)
        if found:
            problems[str(v)] = found
    if described["latest_problem"]:
        problems["LATEST"] = [described["latest_problem"]]
    if described["pin_problem"]:
        problems["PIN"] = [described["pin_problem"]]
    elif str(pinned) in problems:
        problems["PIN"] = [f"{store.base}/PIN names version {pinned}, which does not load (above): remove the pin "
                           "(streamrec store unpin) or pin a version that loads"]
    return {"model": store.model, "root": store.base, "checked": sorted(checked), "deleted_during_check": sorted(gone),
            "ok": not problems, "problems": problems}


class _FileChecks:
    """Each version's (or image's) files, read and checked once however many chains need them."""

    def __init__(self, store: ModelStore) -> None:
        self.store = store
        self.found: dict[tuple[int, bool], str | None] = {}

    def problem(self, version: int, image: bool = False) -> str | None:
        key = (version, image)
        if key not in self.found:
            try:
                self.store.check_version(version, image)
                self.found[key] = None
            except CorruptVersion as exc:
                self.found[key] = str(exc)
        return self.found[key]

    def forget_gone(self) -> None:
        """Drop the failures of versions deleted since they were read (not problems)."""
        self.found = {(v, image): p for (v, image), p in self.found.items() if p is None or self.store.has_version(v, image)}


def _problems(store: ModelStore, version: int, files: _FileChecks, was_present: bool) -> list[str] | None:
    """What keeps ``version`` from loading ([]: nothing); None when it was there at the start
    and has been deleted since."""
    found: list[str] = []
    for _ in range(2):  # once more after a version the chain needed was deleted
        found = _chain_problems(store, version, files)
        if not found:
            return []
        if was_present and not store.has_version(version):
            return None
        files.forget_gone()
    return found


def _chain_problems(store: ModelStore, version: int, files: _FileChecks) -> list[str]:
    try:
        from_image, chain = store.load_plan(version)
    except CorruptVersion as exc:
        return [str(exc)]
    found = [problem] if (problem := files.problem(version)) else []
    for i, v in enumerate(chain):
        image = from_image and i == 0
        if v == version and not image:
            continue
        if problem := files.problem(v, image):
            found.append(f"needs {'the compacted image of ' if image else ''}version {v}: {problem}")
    return found
