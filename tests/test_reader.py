"""The sample reader process: the batches the trainer gets from it are the in-thread
Prefetcher's, with the exchange's layout; its source's failures surface in the trainer."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from conftest import REPO

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.embedding.sharded import layout_on_host
from streamrec.model.batch import SampleBatch, dense_feature_names
from streamrec.model.host_batch import HostBatch
from streamrec.model.sparse import SparseFeatures
from streamrec.trainer.prefetch import END, IDLE, Prefetcher, Skipped
from streamrec.trainer.reader import SampleReader
from streamrec.trainer.reader_process import ReaderSettings, SourceSpec, slot_bytes
from streamrec.trainer.sources import FileSampleSource

SPEC = FeatureSpec()
CPU = torch.device("cpu")


def _drain(get) -> tuple[list, Counter, list]:
    """Every batch until END (each batch's tensors, positions), and the rejections seen; the
    in-thread Prefetcher's arrays made tensors as the trainer's side makes them."""
    batches, rejected, positions = [], Counter(), []
    while (item := get()) is not END:
        assert item is not IDLE
        rejected += item.rejected
        positions.append(dict(item.positions))
        if not isinstance(item, Skipped):
            batches.append(SampleBatch.from_host(item) if isinstance(item, HostBatch) else item)
    return batches, rejected, positions


def _reader(spec: SourceSpec, batch_size: int, world: int | None = None, depth: int = 2) -> SampleReader:
    settings = ReaderSettings(batch_size, SPEC.history_len, depth, None, world)
    return SampleReader(spec, SPEC, settings, CPU, len(dense_feature_names(SPEC))).start()


@pytest.mark.parametrize("world", [None, 2])
def test_the_reader_hands_over_the_prefetchers_batches_with_their_layout(sample_run, world):
    """Through the process (slots smaller than the run's queue, so every slot is used again
    and again) the batches, positions and rejections equal the in-thread Prefetcher's, and
    each batch's layout equals the exchange's own of its ids."""
    source = FileSampleSource([str(sample_run)], SPEC, shard=(1, 2))
    pre = Prefetcher(source, SPEC, 4096, SPEC.history_len).start()
    want, want_rejected, want_positions = _drain(lambda: pre.get(timeout=30))
    pre.stop()

    reader = _reader(SourceSpec(files=[str(sample_run)], shard=(1, 2)), 4096, world)
    try:
        got, got_rejected, got_positions = _drain(lambda: reader.get(timeout=30))
    finally:
        reader.stop()
    assert len(got) == len(want) > reader.slots and got_rejected == want_rejected and got_positions == want_positions
    for a, b in zip(got, want):
        for name in a._tensors():
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.event_ids.equals(b.event_ids) and a.history_len == b.history_len
        if world is None:
            assert a.plan is None
            continue
        laid_out = layout_on_host(SparseFeatures.table_ids(b), world)
        assert a.plan.names == laid_out.names and a.plan.sizes == laid_out.sizes
        assert a.plan.send_counts == laid_out.send_counts and torch.equal(a.plan.routed, laid_out.routed)


def test_a_batch_larger_than_a_slot_still_arrives(sample_run, monkeypatch):
    """A slot too small for a batch (slot_bytes' estimate wrong) sends it in its message."""
    import streamrec.trainer.reader as reader_module

    monkeypatch.setattr(reader_module, "slot_bytes", lambda *args: 4096)
    reader = _reader(SourceSpec(files=[str(sample_run)]), 2048)
    try:
        first = reader.get(timeout=30)
    finally:
        reader.stop()
    assert len(first) == 2048 and first.user.shape == (2048,)


def test_slots_hold_a_full_batch_with_its_layout():
    """The slot estimate covers the largest batch: every history full, every id laid out."""
    b, length, width = 512, SPEC.history_len, len(dense_feature_names(SPEC))
    ids = b * (7 + 2 * length)
    tensors = [b * 8] * 5 + [b * 4, b * width * 4, b * 3 * 8] + [b * length * 8] * 3 + [b * 8]
    assert slot_bytes(b, length, width, laid_out=True) >= sum(tensors) + 2 * ids * 8


def test_a_missing_sample_file_fails_the_start_with_its_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sample file"):
        _reader(SourceSpec(files=[str(tmp_path / "none")]), 128)


def test_a_missing_topic_fails_the_start_with_its_message(broker):
    spec = SourceSpec(bootstrap=broker, topic="streamrec.no-such-topic", group="reader-test", timeout_s=10)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _reader(spec, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_batch_reaches_the_device_intact_while_slots_are_reused(sample_run):
    """Batches view page-locked slots and cross in one asynchronous copy each; a slot goes
    back to the reader only once its copy has run, so no batch is overwritten in flight."""
    device = torch.device("cuda")
    pre = Prefetcher(FileSampleSource([str(sample_run)], SPEC), SPEC, 4096, SPEC.history_len).start()
    want, _, _ = _drain(lambda: pre.get(timeout=30))
    pre.stop()
    settings = ReaderSettings(4096, SPEC.history_len, 2, None, 2)
    reader = SampleReader(SourceSpec(files=[str(sample_run)]), SPEC, settings, device, len(dense_feature_names(SPEC))).start()
    got = []
    try:
        while (item := reader.get(timeout=30)) is not END:
            if not isinstance(item, Skipped) and item is not IDLE:
                routed = item.plan.routed.to(device, non_blocking=True)
                got.append((item.to(device, non_blocking=True), routed))
    finally:
        reader.stop()
    assert len(got) == len(want) > reader.slots
    for (a, routed), b in zip(got, want):
        for name in b._tensors():
            assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), name
        assert torch.equal(routed.cpu(), layout_on_host(SparseFeatures.table_ids(b), 2).routed)


def test_ctrl_c_stops_the_trainer_cleanly_and_its_reader_with_it(sample_run, tmp_path):
    """A terminal's Ctrl-C reaches the trainer's whole process group, the reader included:
    the trainer still finishes its step, publishes and checkpoints (exit 0, its summary
    printed), and no process of the group is left."""
    cmd = [sys.executable, "-m", "streamrec.cli", "train", "--samples", str(sample_run), "--loop", "--batch-size", "512",
           "--device", "cpu", "--no-frozen", "--no-announce", "--json", "--publish-interval", "1",
           "--model-store", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any("published version 1 " in line for line in lines) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert any("published version 1 " in line for line in lines), "".join(lines[-20:])
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    assert proc.returncode == 0, "".join(lines[-30:])
    summary = json.loads(out)
    assert summary["samples_this_run"] > 0 and summary["published"] and any((tmp_path / "work").glob("*/checkpoints/*"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the reader process exits with the trainer
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a process of the trainer's group outlived it")


def test_slots_fall_back_to_the_temp_directory_when_dev_shm_is_full(sample_run, monkeypatch):
    """/dev/shm without room (a container's default 64 MiB): the slots go to the temp
    directory with a warning, and the batches still arrive; nothing is left in either."""
    import streamrec.trainer.reader as reader_module

    real = os.posix_fallocate
    made = []

    def full_dev_shm(fd, offset, size):
        made.append(os.readlink(f"/proc/self/fd/{fd}"))
        if made[-1].startswith("/dev/shm/"):
            raise OSError(28, "No space left on device")
        return real(fd, offset, size)

    monkeypatch.setattr(reader_module.os, "posix_fallocate", full_dev_shm)
    reader = _reader(SourceSpec(files=[str(sample_run)]), 512)
    try:
        assert len(reader.get(timeout=30)) == 512
    finally:
        reader.stop()
    assert made[0].startswith("/dev/shm/") and not made[1].startswith("/dev/shm/") and len(made) == 2
    assert not any(os.path.exists(p.removesuffix(" (deleted)")) for p in made)


def test_a_reader_that_dies_fails_the_next_get_with_its_exit(sample_run):
    """The reader killed (the OOM killer, say): the trainer's next get says so, with the
    signal, instead of waiting for batches that will never come."""
    reader = _reader(SourceSpec(files=[str(sample_run)], loop=True), 512)
    try:
        assert len(reader.get(timeout=30)) == 512
        reader._process.send_signal(signal.SIGKILL)
        reader._process.wait(timeout=10)
        with pytest.raises(RuntimeError, match=r"sample reader process died \(exit code -9\)"):
            for _ in range(100):  # batches already sent may still be read first
                reader.get(timeout=5)
    finally:
        reader.stop()
