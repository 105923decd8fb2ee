"""The served model: one version at a time, changed in place, with undo data for rollback.

Applying a version:
- a **delta** whose parent is the version being served is applied in place: its sparse
  rows through the embedding tables' ``upsert`` and ``erase`` (undone the same way), its
  dense tensors copied into the existing parameters (so anything holding them, e.g.
  captured CUDA graphs, sees the new values). The rows it overwrites or removes, and the
  old dense tensors, are kept as an undo record (the last ``undo_depth`` ones);
- anything else (a full version, a gap in the chain, a version older than the current
  one) is loaded as a fresh model and swapped in; the previous model object is the undo.

Pins: a rollback, or a reload to an explicit version, writes a pin into the model store
(``ModelStore.pin``: who, when, why) once this node serves that version, and only for a
version whose whole chain is in the store (``ModelStore.check_present``). Every node follows
the store's pin at its next look (``catch_up``), a node started later included, until
``:reload`` without a version (or ``streamrec store unpin``) removes it. A garbage or
dangling ``LATEST`` never stops a node: it follows the newest version that verifies and
says why in ``latest_problem``. Nor does a pin it cannot follow (unreadable, or naming a
version that does not load): a node stays where it is, one that serves nothing yet follows
LATEST, and both say why. A node whose served version's files are damaged in the store
after it loaded them keeps serving it from memory and says that no node starting now can.

Consistency: every batch runs under a shared lock and every apply/rollback mutates under
the exclusive one, so a batch sees exactly one version (never sparse rows of N with
dense weights of N+1). Everything slow (reading, verifying and decoding the version's
files) happens before the exclusive lock is taken. A version that fails its checks is
refused (``CorruptVersion``) and the served state is untouched, and so is a sound version
trained with another feature spec than the node serves (``IncompatibleVersion``): its
counters would be read as other features.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from streamrec.model.batch import SampleBatch
from streamrec.model.inference import manifest_spec
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.plumbing.locks import RWLock
from streamrec.modelstore.store import CorruptVersion, ModelStore, Pin, sparse_arrays
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.runtime.version import DenseOnDevice, ServedVersion

log = logging.getLogger(__name__)
FILES_CHECK_INTERVAL_S = 10.0  # how often a node checks that the store still holds the files of what it serves


@dataclass
class _SparseUndo:
    restore_keys: torch.Tensor  # rows that existed before: put these values back
    restore_values: torch.Tensor
    remove_keys: torch.Tensor  # rows the delta created: remove them


@dataclass
class UndoRecord:
    version_before: int
    manifest_before: dict = field(default_factory=dict)
    sparse: dict[str, _SparseUndo] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    replaced: ServedVersion | None = None  # a whole model swapped out (full version / reload)


@dataclass
class ApplyReport:
    version: int
    previous: int
    mode: str  # "delta" (in place) or "swap" (fresh model)
    rows: int
    prepare_s: float  # reading + verifying + decoding, outside the lock
    locked_s: float  # time batches were held off


def _one_change_at_a_time(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: "ServedModel", *args, **kwargs):
        with self._changing:
            return method(self, *args, **kwargs)
    return wrapper


class IncompatibleVersion(CorruptVersion):
    """A sound version this node must not serve: it was trained with another feature spec."""


class PinNotRecorded(RuntimeError):
    """The model store did not take a pin (read-only, unreachable): the node goes back to what
    it served before the call where it can; the message says which version it serves."""


class ServedModel:
    def __init__(self, model_store: ModelStore, device: torch.device | str = "cpu", gpu_cache_rows: int = 1_000_000,
                 undo_depth: int = 8, runtime: RuntimeConfig | None = None, feature_spec: FeatureSpec | None = None) -> None:
        """``runtime``: how versions run (buckets, compile mode, workers); None runs them eagerly.
        ``feature_spec``: the node's (``[features]``); None: the first version's, kept from then on."""
        self.model_store = model_store
        self.feature_spec = feature_spec
        self.device = torch.device(device)
        self.runtime = runtime
        self.gpu_cache_rows = gpu_cache_rows
        self.undo_depth = undo_depth
        self.lock = RWLock()
        # One version change at a time (watcher, :reload, :rollback): a change decides what
        # to apply and applies it without another change in between (a rollback's pin is
        # never overtaken by a catch-up that began before it; no delta is applied twice).
        self._changing = threading.RLock()
        self.current: ServedVersion | None = None
        self.undo: list[UndoRecord] = []
        self.pin: Pin | None = None  # the store's pin this node follows: automatic applies stop until it is released
        self._latest_problem: str | None = None  # why LATEST or the pin is not followed (garbage, dangling, broken chain)
        self._damaged: tuple[int, str] | None = None  # a served version whose files the store no longer holds, and how
        self.files_check_interval_s = FILES_CHECK_INTERVAL_S
        self._next_files_check = 0.0
        self.applied_at: dict[int, float] = {}
        self.recent_applies: deque[ApplyReport] = deque(maxlen=32)  # what each change cost (status: "applies")
        self.refused: dict[int, str] = {}  # version -> why it was not applied

    @property
    def version(self) -> int | None:
        return self.current.version if self.current is not None else None

    @property
    def pinned(self) -> bool:
        return self.pin is not None

    @property
    def served_problem(self) -> str | None:
        """Why a node starting now could not load the served version, as the last check found."""
        return self._damaged[1] if self._damaged is not None and self._damaged[0] == self.version else None

    @property
    def latest_problem(self) -> str | None:
        """Why this node does not serve what the store says (LATEST or the pin unusable), or
        why a node starting now could not serve what it does (its files damaged since)."""
        return "; ".join(p for p in (self._latest_problem, self.served_problem) if p) or None

    # ------------------------------------------------------------------ serving
    def predict(self, batch: SampleBatch, now_ms: int | None = None, dense: DenseOnDevice | None = None) -> tuple[int, np.ndarray]:
        """(version, scores) of one batch, all from one version (``dense``: see ServedVersion.predict)."""
        with self.lock.read():
            if self.current is None:
                raise LookupError(f"model {self.model_store.model} has no version loaded yet")
            return self.current.version, self.current.predict(batch, now_ms, dense)

    # ------------------------------------------------------------------ changing versions
    @_one_change_at_a_time
    def load(self, version: int | None = None, pin: bool = False, by: str = "", reason: str = "") -> ApplyReport:
        """Serve ``version`` (default: LATEST), in place when it is the next delta, else by a
        swap. ``pin``: and make every node stay on it until released (an operator's explicit
        version: unpinned, the watcher would move on to LATEST at its next poll). The pin is
        recorded in the store only once this node serves the version, in the same change, so
        no catch-up can slip in between and a version that does not load is never pinned."""
        target = self.model_store.resolve_latest()[0] if version is None else version
        if target is None:
            raise CorruptVersion(f"model {self.model_store.model} has no published version under {self.model_store.base}")
        manifest = self.model_store.manifest(target)
        self._check_spec(target, manifest)
        if pin:
            self.model_store.check_present(target)  # every node will load it: its whole chain, not just this node's step
        current = self.version
        if current is not None and manifest["kind"] == "delta" and manifest["parent"] == current:
            report = self._apply_delta(target)
        else:
            report = self._swap(target)
        if pin:
            self._record_pin(target, by, reason, back_to=current)
        return report

    def _record_pin(self, version: int, by: str, reason: str, back_to: int | None) -> None:
        """Pin ``version``, which this node now serves; when the store does not take the pin,
        serve ``back_to`` again (what was served before the change) and raise."""
        try:
            self.pin = self.model_store.pin(version, by, reason)
        except OSError as exc:
            where = self._return_to(back_to)
            raise PinNotRecorded(f"the pin to version {version} could not be written to the model store "
                                 f"({self.model_store.base}): {exc}; {where}") from None
        log.warning("pinned version %d of %s (by %s%s)", version, self.model_store.model, by, f": {reason}" if reason else "")

    def _return_to(self, version: int | None) -> str:
        """After a change whose pin failed: serve ``version`` again; says where the node is."""
        if version is None or version == self.version:
            return f"this node serves version {self.version}"
        try:
            self._go_to(version)
            return f"this node is back on version {version}"
        except (CorruptVersion, OSError) as exc:
            log.error("could not return to version %d after a failed pin: %s", version, exc)
            return f"this node serves version {self.version} until its next catch-up ({exc})"

    @_one_change_at_a_time
    def catch_up(self) -> list[ApplyReport]:
        """Apply every version after the current one up to LATEST, in order (the watcher's job),
        or the store's pin; then, every ``files_check_interval_s``, whether the served version's
        files are still in the store.

        Never raises for a bad version: it is recorded in ``refused`` (and logged) and the
        served version stays. Deltas that depend on a refused version cannot apply; the next
        full version (or a loadable LATEST chain) gets the server going again.
        """
        reports, pin_problem = self._follow_pin()
        if pin_problem and pin_problem not in (self._latest_problem or ""):
            log.error("%s", pin_problem)
        latest_problem = None
        if reports is None:
            reports, latest_problem = self._follow_latest()
        problems = "; ".join(p for p in (pin_problem, latest_problem) if p) or None
        if self._latest_problem and not problems:
            log.info("the store's LATEST and PIN are sound again")
        self._latest_problem = problems
        self._check_served_files()
        return reports

    def _follow_latest(self) -> tuple[list[ApplyReport], str | None]:
        """(what was applied, why LATEST itself is not served)."""
        latest, problem = self.model_store.resolve_latest()
        if problem and problem not in (self._latest_problem or ""):  # once, not at every poll
            log.error("%s; following version %s, the newest in the store", problem, latest)
        if latest is None or (self.version is not None and latest <= self.version):
            return [], problem
        reports = []
        if self.version is not None:
            for v in [v for v in self.model_store.versions() if self.version < v <= latest and v not in self.refused]:
                try:
                    manifest = self.model_store.manifest(v)
                    self._check_spec(v, manifest)
                    if manifest["kind"] == "delta" and manifest["parent"] == self.version:
                        reports.append(self._apply_delta(v))
                    elif manifest["kind"] == "full":
                        reports.append(self._swap(v))
                except CorruptVersion as exc:
                    self._refuse(v, exc)
        if self.version != latest and latest not in self.refused:  # first load, or a gap (garbage-collected versions)
            try:
                self._check_spec(latest, self.model_store.manifest(latest))
                reports.append(self._swap(latest))
            except CorruptVersion as exc:
                self._refuse(latest, exc)
        if self.version is None:  # nothing served: the newest version that loads, rather than nothing
            for v in reversed(self.model_store.versions()):
                if v < latest and v not in self.refused:
                    try:
                        self._check_spec(v, self.model_store.manifest(v))
                        reports.append(self._swap(v))
                        break
                    except CorruptVersion as exc:
                        self._refuse(v, exc)
        if latest in self.refused and self.version != latest and not problem:  # e.g. a delta of its chain is gone
            problem = (f"LATEST (version {latest}) cannot be served: {self.refused[latest]}; serving version "
                       f"{self.version} until a version that loads (a full one) is published")
        return reports, problem

    def _follow_pin(self) -> tuple[list[ApplyReport] | None, str | None]:
        """(reports when the store's pin decides what is served, None to follow LATEST; why the
        pin cannot be followed). A pin released elsewhere (another node's :reload, `streamrec
        store unpin`) releases it here. A pin that cannot be followed (unreadable, or naming a
        version that does not load) keeps a node where it is, and a node that serves nothing
        yet follows LATEST rather than serve nothing."""
        try:
            pin = self.model_store.pinned()
        except CorruptVersion as exc:
            return self._pin_unusable(str(exc))
        if pin is None:
            if self.pin is not None:
                log.warning("pin to version %d released: following LATEST again", self.pin.version)
            self.pin = None
            return None, None
        if pin.version != self.version and pin.version not in self.refused:
            try:
                reports = [self._go_to(pin.version)]
            except CorruptVersion as exc:
                self._refuse(pin.version, exc)
            else:
                self.pin = pin
                return reports, None
        if pin.version == self.version:
            self.pin = pin
            return [], None
        return self._pin_unusable(f"{self.model_store.base}/PIN names version {pin.version}, which cannot be served "
                                  f"({self.refused[pin.version]}); remove the pin (streamrec store unpin, or :reload {{}} "
                                  "on a serving node) or pin a version that loads")

    def _pin_unusable(self, why: str) -> tuple[list[ApplyReport] | None, str]:
        """Stay on the served version; with none, follow LATEST (None). Says which."""
        if self.version is None:
            return None, f"{why}; following LATEST meanwhile"
        return [], f"{why}; this node stays on version {self.version} meanwhile"

    def _check_served_files(self) -> None:
        """Whether a node starting now could load the served version: its files damaged after
        this node loaded them leave it serving from memory what no other node can, which it
        says (``served_problem``). Sizes only (``ModelStore.check_present``), and at most
        every ``files_check_interval_s``: rereading every file would cost a load."""
        now = time.monotonic()
        if self.version is None or now < self._next_files_check:
            return
        self._next_files_check = now + self.files_check_interval_s
        version = self.version
        try:
            self.model_store.check_present(version)
        except CorruptVersion as exc:
            if self.served_problem is None:
                log.error("the files of version %d, which this node serves, are damaged in the store: %s", version, exc)
            self._damaged = (version, f"version {version}, which this node serves from memory, cannot be loaded from the "
                                      f"store any more ({exc}): a node starting now cannot serve it; publish a full version "
                                      "(a trainer's next start does) or roll back to a version that loads")
            return
        except OSError as exc:  # the store unreachable: nothing learnt about the files
            log.warning("could not check the files of version %d: %s", version, exc)
            return
        self._damaged = None

    def _go_to(self, version: int) -> ApplyReport:
        """Serve ``version``: from the undo records when they reach it, else loaded from the store."""
        if version in [u.version_before for u in self.undo]:
            return self._undo_to(version)
        self._check_spec(version, self.model_store.manifest(version))
        return self._swap(version)

    def _check_spec(self, version: int, manifest: dict) -> None:
        """Refuse a version trained with another feature spec than this node's."""
        if self.feature_spec is None:
            return
        spec = manifest_spec(manifest, "feature_spec", f"version {version} of {self.model_store.model}")
        differences = self.feature_spec.differences(spec)
        if differences:
            raise IncompatibleVersion(
                f"version {version} was trained with another feature spec than this node serves ([features]: "
                f"{'; '.join(differences)}, the version's first); serve it with that [features] section")

    def _refuse(self, version: int, exc: Exception) -> None:
        self.refused[version] = str(exc)
        log.error("version %d refused, still serving %s: %s", version, self.version, exc)

    @_one_change_at_a_time
    def rollback(self, version: int | None = None, by: str = "", reason: str = "") -> ApplyReport:
        """Back to ``version`` (default: the previous one), pinned in the store for every node.
        From the undo records when they reach it (instant), else loaded from the store."""
        if version is None:
            if not self.undo:
                raise LookupError("no earlier version to roll back to (no undo data kept): name one, {\"version\": N}")
            version = self.undo[-1].version_before
        self.model_store.check_present(version)  # undo data may reach it; a node starting now must load it too
        current = self.version
        report = self._go_to(version)  # a version that does not load raises here, before any pin
        self._record_pin(version, by, reason, back_to=current)
        return report

    def _undo_to(self, target: int) -> ApplyReport:
        t0 = time.perf_counter()
        previous = self.version
        with self.lock.write():
            while self.version != target:
                self._undo_one(self.undo.pop())
            self._settle()
        return ApplyReport(target, previous, "rollback", 0, 0.0, time.perf_counter() - t0)

    @_one_change_at_a_time
    def release(self) -> Pin | None:
        """Remove the store's pin (``:reload``): every node follows LATEST again."""
        released = self.model_store.unpin()
        self.pin = None
        return released

    # ------------------------------------------------------------------ internals
    def _apply_delta(self, version: int) -> ApplyReport:
        t0 = time.perf_counter()
        manifest, sparse, dense = self.model_store.read_version(version)  # verified; may raise CorruptVersion
        decoded = {}
        for name, table in sparse.items():
            keys, deleted, values = sparse_arrays(table, manifest["tables"][name]["dim"])
            decoded[name] = (torch.from_numpy(keys[~deleted]), torch.from_numpy(values[~deleted]), torch.from_numpy(keys[deleted]))
        model = self.current
        unknown = set(decoded) - set(model.embeddings.tables)
        if unknown:
            raise CorruptVersion(f"version {version} has tables {sorted(unknown)} the served model does not")
        params = dict(model.network.state_dict())
        for name, tensor in dense.items():
            if name not in params or params[name].shape != tensor.shape:
                raise CorruptVersion(f"version {version}: dense tensor {name} {tuple(tensor.shape)} does not fit the served model")
        # The undo record reads what is served now: only this thread changes it (one change at a
        # time), so this happens before batches are held off; the lookup guard's shared side
        # keeps lookups from moving rows between tiers meanwhile.
        record = UndoRecord(model.version, model.manifest)
        with model.inference.lookup_guard.read():
            for name, (keys, values, deleted) in decoded.items():
                existed, old, absent = model.embeddings[name].export(torch.cat([keys, deleted]))
                record.sparse[name] = _SparseUndo(existed, old, absent)
        with torch.no_grad():
            for name, tensor in dense.items():
                record.dense[name] = params[name].detach().clone()
                dense[name] = tensor.to(params[name].device, non_blocking=True)
        prepared = time.perf_counter()
        rows = 0
        with self.lock.write():
            for name, (keys, values, deleted) in decoded.items():
                table = model.embeddings[name]
                table.upsert(keys, values)
                if len(deleted):
                    table.erase(deleted)
                rows += len(keys) + len(deleted)
            with torch.no_grad():
                for name, tensor in dense.items():
                    params[name].copy_(tensor)
            model.inference.version, model.inference.manifest = version, manifest
            self._push_undo(record)
            self._settle()
        return self._applied(ApplyReport(version, record.version_before, "delta", rows, prepared - t0, time.perf_counter() - prepared))

    def _swap(self, version: int) -> ApplyReport:
        t0 = time.perf_counter()
        # verified; its buckets are compiled here, before it serves (batches keep running meanwhile)
        fresh = ServedVersion.load(self.model_store, version, self.device, self.gpu_cache_rows, self.runtime)
        if self.feature_spec is None:
            self.feature_spec = fresh.feature_spec
        prepared = time.perf_counter()
        with self.lock.write():
            previous = self.current
            self.current = fresh
            if previous is not None:
                self._push_undo(UndoRecord(previous.version, previous.manifest, replaced=previous))
        rows = sum(len(t) for t in fresh.embeddings.tables.values())
        return self._applied(ApplyReport(version, previous.version if previous else -1, "swap", rows, prepared - t0,
                                         time.perf_counter() - prepared))

    def _applied(self, report: ApplyReport) -> ApplyReport:
        self.applied_at[report.version] = time.time()
        self.recent_applies.append(report)
        return report

    def applies(self) -> list[dict]:
        """The last changes: version, mode, rows, prepare and locked milliseconds."""
        return [{**asdict(r), "prepare_ms": round(1000 * r.prepare_s, 2), "locked_ms": round(1000 * r.locked_s, 2)}
                for r in list(self.recent_applies)]

    def _settle(self) -> None:
        """Wait for the in-place writes (issued on this thread's stream) before batches run
        again: workers run on streams of their own, which do not wait for this one."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _push_undo(self, record: UndoRecord) -> None:
        self.undo.append(record)
        while len(self.undo) > self.undo_depth:
            dropped = self.undo.pop(0)
            if dropped.replaced is not None:
                dropped.replaced.close()

    def _undo_one(self, record: UndoRecord) -> None:
        """Reverse one record (caller holds the write lock)."""
        if record.replaced is not None:
            self.current.close()
            self.current = record.replaced
            return
        model = self.current
        for name, undo in record.sparse.items():
            table = model.embeddings[name]
            if len(undo.remove_keys):
                table.erase(undo.remove_keys)
            table.upsert(undo.restore_keys, undo.restore_values)
        params = dict(model.network.state_dict())
        with torch.no_grad():
            for name, tensor in record.dense.items():
                params[name].copy_(tensor)
        model.inference.version, model.inference.manifest = record.version_before, record.manifest_before

    def close(self) -> None:
        with self.lock.write():
            for record in self.undo:
                if record.replaced is not None:
                    record.replaced.close()
            self.undo.clear()
            if self.current is not None:
                self.current.close()
                self.current = None
