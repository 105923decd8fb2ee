"""Model store faults an operator can cause by hand: bytes in LATEST that are no version
number, an unreadable or dangling PIN, a manifest whose parent chain loops, `store verify`
racing the trainer's retention, and a served version whose files are damaged after a node
loaded it. Each gets a clear error naming the file, loses nothing, and takes no node out:
the store tools repair or say what to do, and the command they suggest works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import REPO, copy_store, free_port, run_cli
from test_store_safety import TOKEN, http
from test_store_safety import start_node as serve_store
from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import CorruptVersion, ModelStore
from streamrec.modelstore.writer import VersionWriter

BAD_LATEST = {"non-utf8": (b"\xff\xfe", r"b'\xff\xfe'"), "superscript-two": ("²\n".encode(), "'²'")}


def small_store(root: Path, versions: int = 4) -> ModelStore:
    """A full version and ``versions - 1`` deltas of one 4-wide table and one dense tensor."""
    store = ModelStore(str(root), "ctr")
    writer = VersionWriter(store)
    for n in range(versions):
        keys = torch.arange(n, n + 6)
        writer.publish("full" if n == 0 else "delta", {"t": SparseDelta(keys, torch.full((6, 4), float(n)))}, {"t": 4},
                       {"w": torch.full((3,), float(n))})
    return store


def set_parent(root: Path, version: int, parent: int) -> None:
    path = root / "ctr" / "versions" / f"{version:012d}" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["parent"] = parent
    path.write_text(json.dumps(manifest))


def start_node(store_root: Path) -> tuple[subprocess.Popen, str]:
    """A real `streamrec serve` on CPU polling LATEST every 0.2 s, admin routes on, without
    online features or a model-updates topic: (process, base URL)."""
    port = free_port()
    return serve_store(store_root, port), f"http://127.0.0.1:{port}"


def stop_node(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def wait_until(check, what: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until ``check()`` is true; fails with the node's output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (urllib.error.URLError, ConnectionError):
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the node exited ({proc.returncode}) waiting for {what}:\n{proc.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def status(base: str) -> dict:
    code, answer = http(base, "GET", "/v1/models/ctr")
    assert code == 200, answer
    return answer


def ready(base: str) -> dict | None:
    code, answer = http(base, "GET", "/readyz")
    return answer if code == 200 else None


# ---------------------------------------------------------------- 1: LATEST that is no ASCII number
@pytest.mark.parametrize("bad", BAD_LATEST)
def test_the_store_tools_name_a_latest_that_is_no_ascii_number(tmp_path, bad):
    data, shown = BAD_LATEST[bad]
    store = small_store(tmp_path / "models")
    latest = tmp_path / "models" / "ctr" / "LATEST"
    latest.write_bytes(data)
    with pytest.raises(CorruptVersion, match="not a version number"):
        store.latest()
    problem = f"{latest} holds {shown}, not a version number"
    assert store.resolve_latest() == (4, problem + " (ASCII digits)")
    listed = run_cli("store", "ls", "--model-store", str(tmp_path / "models"))
    assert listed.returncode == 0 and f"LATEST: {problem}" in listed.stdout, listed.stderr
    verified = run_cli("store", "verify", "--model-store", str(tmp_path / "models"))
    assert verified.returncode == 1 and f"LATEST: {problem}" in verified.stdout, verified.stdout + verified.stderr
    assert latest.read_bytes() == data  # reported, not changed: the trainer's next version repairs it


@pytest.mark.parametrize("bad", BAD_LATEST)
def test_the_trainer_repairs_a_latest_that_is_no_ascii_number(published_model, sample_run, tmp_path, bad):
    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    work = shutil.copytree(shared.parent / "work", tmp_path / "work")
    (models / "ctr" / "LATEST").write_bytes(BAD_LATEST[bad][0])
    trained = run_cli("train", "--samples", str(sample_run), "--model-store", str(models), "--work-dir", str(work),
                      "--max-samples", "2000", "--publish-interval", "0.2", "--device", "cpu", "--no-announce", "--no-frozen")
    assert trained.returncode == 0, trained.stderr[-3000:]
    store = ModelStore(str(models), "ctr")
    assert store.versions()[-1] > versions[-1]
    assert (models / "ctr" / "LATEST").read_text() == f"{store.versions()[-1]}\n"
    assert store.load().version == store.versions()[-1]


def test_a_node_serves_and_reports_a_latest_that_is_no_ascii_number(published_model, tmp_path):
    """A node started on such a LATEST serves the newest version and says why in its status and
    /readyz; a running node whose LATEST turns into another such value keeps answering."""
    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    latest = models / "ctr" / "LATEST"
    latest.write_bytes(BAD_LATEST["non-utf8"][0])
    proc, base = start_node(models)
    try:
        wait_until(lambda: ready(base) is not None, "the node ready", proc)
        answer = status(base)
        assert answer["model_version"] == versions[-1]
        assert f"{latest} holds {BAD_LATEST['non-utf8'][1]}, not a version number" in answer["latest_problem"], answer
        assert "not a version number" in ready(base)["models"]["ctr"]["latest_problem"]
        latest.write_bytes(BAD_LATEST["superscript-two"][0])
        wait_until(lambda: "holds '²'" in (ready(base)["models"]["ctr"]["latest_problem"] or ""), "the running node to report '²'", proc)
        assert "holds '²'" in status(base)["latest_problem"]
        latest.write_text(f"{versions[-1]}\n")
        wait_until(lambda: ready(base)["models"]["ctr"]["latest_problem"] is None, "the problem to clear", proc)
    finally:
        stop_node(proc)


# ---------------------------------------------------------------- 3: an unreadable or dangling PIN
UNREADABLE_PINS = {"garbage": b"garbage\n", "non-utf8": b"\xff\xfe", "superscript-version": '{"version": "²", "by": "x", "at": 1}'.encode(),
                   "deep-nesting": b"[" * 200_000, "not-an-object": b"[1, 2]"}


@pytest.mark.parametrize("pin", UNREADABLE_PINS)
def test_store_unpin_removes_an_unreadable_pin(tmp_path, pin):
    root = tmp_path / "models"
    small_store(root)
    pin_file = root / "ctr" / "PIN"
    pin_file.write_bytes(UNREADABLE_PINS[pin])
    listed = run_cli("store", "ls", "--model-store", str(root))
    assert listed.returncode == 0, listed.stderr
    assert f"PIN: {pin_file} is not a valid pin" in listed.stdout and "streamrec store unpin" in listed.stdout, listed.stdout
    verified = run_cli("store", "verify", "--model-store", str(root))
    assert verified.returncode == 1 and f"PIN: {pin_file} is not a valid pin" in verified.stdout, verified.stdout + verified.stderr
    unpinned = run_cli("store", "unpin", "--model-store", str(root))  # what the messages above tell the operator to run
    assert unpinned.returncode == 0, unpinned.stderr
    assert f"removed {pin_file}, which was not a valid pin" in unpinned.stdout
    assert not pin_file.exists()
    assert run_cli("store", "verify", "--model-store", str(root)).returncode == 0


class _FailingMoves:
    """A store's filesystem whose renames fail, as on a full disk; everything else real."""

    def __init__(self, fs) -> None:
        self._fs = fs

    def move(self, src: str, dest: str) -> None:
        raise OSError(28, "No space left on device")

    def __getattr__(self, name: str):
        return getattr(self._fs, name)


def test_a_pin_that_cannot_be_written_leaves_no_temp_file_and_the_old_pin(tmp_path):
    root = tmp_path / "models"
    store = small_store(root)
    store.pin(2, by="first")
    store.files.fs = _FailingMoves(store.files.fs)
    with pytest.raises(OSError, match="No space left"):
        store.pin(3, by="second")
    assert sorted(p.name for p in (root / "ctr").iterdir() if p.name.startswith(".")) == []
    assert store.pinned().version == 2


@pytest.mark.parametrize("pin", ["garbage", "dangling"])
def test_a_node_started_on_an_unusable_pin_serves_latest_and_reload_removes_the_pin(published_model, tmp_path, pin):
    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    pin_file = models / "ctr" / "PIN"
    pin_file.write_text("garbage\n" if pin == "garbage" else json.dumps({"version": 999, "by": "someone", "at": 1.0, "reason": ""}))
    proc, base = start_node(models)
    try:
        wait_until(lambda: ready(base) is not None, "the node to serve a version", proc)
        answer = status(base)
        assert answer["model_version"] == versions[-1] and not answer["pinned"], answer
        why = "is not a valid pin" if pin == "garbage" else "names version 999, which cannot be served"
        # before its first version, the node follows LATEST; from its next poll on, it stays there
        assert why in answer["latest_problem"] and ("following LATEST" in answer["latest_problem"] or
                                                    f"stays on version {versions[-1]}" in answer["latest_problem"]), answer["latest_problem"]
        assert "streamrec store unpin" in answer["latest_problem"]
        assert why in ready(base)["models"]["ctr"]["latest_problem"]
        code, reloaded = http(base, "POST", "/v1/models/ctr:reload", {}, TOKEN)  # the other fix the message names
        assert code == 200 and reloaded["model_version"] == versions[-1] and not reloaded["pinned"], reloaded
        assert not pin_file.exists()
        assert status(base)["latest_problem"] is None
    finally:
        stop_node(proc)


def test_a_running_node_stays_on_its_version_under_an_unusable_pin_and_says_why(published_model, tmp_path):
    from streamrec.serving.runtime.state import ServedModel

    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    node = ServedModel(ModelStore(str(models), "ctr"))
    node.load(versions[-2])
    (models / "ctr" / "PIN").write_text(json.dumps({"version": 999, "by": "someone", "at": 1.0}))
    assert node.catch_up() == [] and node.version == versions[-2]
    assert "names version 999, which cannot be served" in node.latest_problem
    assert f"this node stays on version {versions[-2]}" in node.latest_problem
    node.release()
    assert [r.version for r in node.catch_up()] == [versions[-1]] and node.latest_problem is None
    node.close()


# ---------------------------------------------------------------- 4: a parent cycle
@pytest.mark.parametrize("cycle", ["self", "two"])
def test_store_verify_reports_a_parent_cycle_as_a_corrupt_version(tmp_path, cycle):
    root = tmp_path / "models"
    store = small_store(root)
    set_parent(root, 4, 4) if cycle == "self" else set_parent(root, 3, 4)  # two: 4 -> 3 -> 4
    looped = 4 if cycle == "self" else 3
    manifest = root / "ctr" / "versions" / f"{looped:012d}" / "manifest.json"
    verified = run_cli("store", "verify", "--model-store", str(root), timeout=60)
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert f"{looped}: {manifest}: a delta's parent must be an earlier version than {looped}, not 4" in verified.stdout, verified.stdout
    flagged = {line.split(":", 1)[0] for line in verified.stdout.splitlines()} & {"1", "2", "3", "4"}
    assert flagged == ({"3", "4"} if cycle == "two" else {"4"}), verified.stdout
    listed = run_cli("store", "ls", "--model-store", str(root), timeout=60)
    assert listed.returncode == 0 and "parent must be an earlier version" in listed.stdout, listed.stdout + listed.stderr
    with pytest.raises(CorruptVersion, match="parent must be an earlier version"):
        store.chain(4)


def test_a_node_serves_past_a_latest_whose_parent_is_itself(published_model, tmp_path):
    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    set_parent(models, versions[-1], versions[-1])
    proc, base = start_node(models)
    try:
        wait_until(lambda: ready(base) is not None, "the node to serve a version", proc)
        answer = status(base)
        assert answer["model_version"] == versions[-2], answer
        assert f"LATEST (version {versions[-1]}) cannot be served" in answer["latest_problem"]
        assert "parent must be an earlier version" in answer["refused"][str(versions[-1])]
    finally:
        stop_node(proc)


# ---------------------------------------------------------------- 7: `store verify` on a live store
GATED_CLI = """
import os, runpy, sys, time
from pathlib import Path
from streamrec.modelstore.store import ModelStore
gate, read = Path(os.environ["STORE_FAULTS_GATE"]), ModelStore.check_version
def gated(self, *args, **kwargs):  # the first read waits until the test has run retention
    if not (gate / "go").exists():
        (gate / "waiting").touch()
        while not (gate / "go").exists():
            time.sleep(0.01)
    return read(self, *args, **kwargs)
ModelStore.check_version = gated
sys.argv[0] = "streamrec"
runpy.run_module("streamrec.cli", run_name="__main__")
"""


@pytest.mark.parametrize("which", ["all", "newest"])
def test_store_verify_on_a_live_store_skips_versions_retention_deleted_mid_check(tmp_path, which):
    """The check stops at its first file read while the trainer's compaction and retention run
    (an image of version 5, then every version before it deleted); what it then finds missing
    is no problem, while a version damaged before the check still is."""
    root, gate = tmp_path / "models", tmp_path / "gate"
    gate.mkdir()
    store = small_store(root, 8)
    if which == "all":
        damaged = root / "ctr" / "versions" / f"{7:012d}" / "sparse" / "t.arrow"
        damaged.write_bytes(damaged.read_bytes()[:-8])
    args = ["--version", "8"] if which == "newest" else []
    proc = subprocess.Popen([sys.executable, "-c", GATED_CLI, "store", "verify", "--model-store", str(root), "--json", *args],
                            cwd=REPO, env={**os.environ, "STORE_FAULTS_GATE": str(gate)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (gate / "waiting").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the check never read a file"
            time.sleep(0.02)
        VersionWriter(store).compact(5)
        assert store.gc(keep_fulls=1) == [1, 2, 3, 4]
        (gate / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads(out)
    if which == "newest":
        assert proc.returncode == 0 and report["ok"], out + err
        assert report["checked"] == [8] and report["deleted_during_check"] == []
    else:
        assert proc.returncode == 1, out + err
        assert sorted(report["problems"]) == ["7", "8"], report["problems"]
        assert "fails its checksum" in report["problems"]["7"][0] and "needs version 7" in report["problems"]["8"][0]
        assert report["checked"] == [5, 6, 7, 8] and report["deleted_during_check"] == [1, 2, 3, 4]


def test_store_verify_says_which_versions_it_checked(tmp_path):
    root = tmp_path / "models"
    small_store(root, 5)
    verified = run_cli("store", "verify", "--model-store", str(root))
    assert verified.returncode == 0 and "5 version(s) checked (1-5), all sound" in verified.stdout, verified.stdout
    missing = run_cli("store", "verify", "--model-store", str(root), "--version", "9")  # named, never there: a problem
    assert missing.returncode == 1 and "9: version 9 of ctr has no manifest" in missing.stdout, missing.stdout
    some = run_cli("store", "verify", "--model-store", str(root), "--version", "2", "4", "--version", "3", "--json")
    assert some.returncode == 0 and json.loads(some.stdout)["checked"] == [2, 3, 4], some.stdout + some.stderr
    one = run_cli("store", "verify", "--model-store", str(root), "--version", "2")  # not LATEST (5) too
    assert one.returncode == 0 and "1 version(s) checked (2), all sound" in one.stdout, one.stdout


# ---------------------------------------------------------------- 9: the served version's files damaged later
def test_a_node_says_when_the_files_of_its_version_are_damaged_in_the_store(published_model, tmp_path):
    """The newest delta is truncated after the node loaded it, with no trainer to publish past
    it: the node keeps serving it from memory and says that a node starting now cannot load
    it; once the file is back the problem clears."""
    shared, versions = published_model
    models = copy_store(shared, tmp_path / "models")
    vdir = models / "ctr" / "versions" / f"{versions[-1]:012d}"
    rel = sorted(json.loads((vdir / "manifest.json").read_text())["files"])[0]
    proc, base = start_node(models)
    try:
        wait_until(lambda: ready(base) is not None, "the node ready", proc)
        assert status(base)["model_version"] == versions[-1] and status(base)["latest_problem"] is None
        intact = (vdir / rel).read_bytes()
        (vdir / rel).write_bytes(intact[: len(intact) // 2])
        wait_until(lambda: "serves from memory" in (ready(base)["models"]["ctr"]["latest_problem"] or ""), "the damage reported", proc, 60)
        problem = status(base)["latest_problem"]
        assert f"version {versions[-1]}, which this node serves from memory, cannot be loaded from the store" in problem, problem
        assert f"{rel} has {len(intact) // 2} bytes" in problem and status(base)["model_version"] == versions[-1]
        (vdir / rel).write_bytes(intact)
        wait_until(lambda: ready(base)["models"]["ctr"]["latest_problem"] is None, "the problem to clear", proc)
    finally:
        stop_node(proc)
