"""Trainer parts: features, the model's inputs, batching positions, publishing, round trips."""

import gc
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from conftest import copy_store, run_cli
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.modelstore.store import ModelStore
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.table import TableConfig
from streamrec.plumbing.config import load_config
from streamrec.trainer.checkpoint import Checkpointer
from streamrec.trainer.driver import Trainer, TrainingError, TrainOptions, train
from streamrec.trainer.loop import WARM_UP_STEPS
from streamrec.model.batch import TABLES, batch_from_table
from streamrec.model.inference import InferenceModel
from streamrec.trainer.prefetch import END, IDLE, Prefetcher, Skipped
from streamrec.trainer.sources import FileSampleSource
from streamrec.model.sparse import SparseFeatures

SPEC = FeatureSpec()


@pytest.fixture(scope="module")
def table(sample_run):
    return pq.read_table(sample_run / "samples.parquet")


def test_history_lands_where_the_model_reads_it(table):
    rows = table.slice(100_000, 400)  # mid-run: users have histories (the run's first samples have none)
    lengths = [len(h) for h in rows["hist_item_ids"].to_pylist()]
    assert sum(0 < n < 8 for n in lengths) > 20 and sum(n > 8 for n in lengths) > 20  # short ones and cut ones
    batch = batch_from_table(rows, SPEC, history_len=8)  # shorter than the samples' 50: keeps the most recent 8
    store = EmbeddingCollection([TableConfig(name, 4) for name in TABLES])
    inputs, _ = SparseFeatures(store).training_inputs(batch, now_ms=0)
    item_rows = {int(k): store["item"].export(torch.tensor([k]))[1][0] for k in torch.unique(torch.cat([batch.item, batch.hist_items]))}
    for i, row in enumerate(rows.to_pylist()):
        hist = row["hist_item_ids"][:8]
        assert inputs.history_mask[i].tolist() == [j < len(hist) for j in range(8)]
        for j, item in enumerate(hist):
            assert torch.equal(inputs.history[i, j, :4], item_rows[item])
        assert torch.equal(inputs.fields[i, 1], item_rows[row["item_id"]])
        assert not inputs.history[i, len(hist):].any()
    assert torch.isfinite(inputs.dense).all() and inputs.dense.shape == (400, 18)


def _positions_check(path, batch_size, expected_rows):
    """Every batch's position is exactly the count of rows handed out (single file)."""
    source = FileSampleSource([str(path)], SPEC, chunk_rows=1000)
    pre = Prefetcher(source, SPEC, batch_size, history_len=50).start()
    seen, ids, rejected = 0, [], Counter()
    while (item := pre.get(timeout=10)) is not END:
        assert item is not IDLE
        rejected += item.rejected
        if isinstance(item, Skipped):
            continue
        ids += item.event_ids.to_pylist()
        seen += len(item)
        # everything before the position was handed out or rejected, and nothing after it
        assert item.positions[0] == seen + sum(rejected.values())
    pre.stop()
    assert ids == expected_rows
    return rejected


def test_batches_cover_the_files_exactly_and_positions_resume_without_gaps(tmp_path, table):
    small = table.slice(0, 5000)
    labels = small["label"].to_numpy().copy()
    labels[[7, 1500, 4999]] = 5  # rejected rows, including the very last one
    bad = small.set_column(small.schema.get_field_index("label"), "label", pa.array(labels, pa.int8()))
    path = tmp_path / "s.parquet"
    pq.write_table(bad, path)
    good_ids = [e for e, lab in zip(small["event_id"].to_pylist(), labels) if lab != 5]
    assert _positions_check(path, 333, good_ids) == {"invalid_value": 3}
    # resume from a mid-file position: exactly the rest, nothing twice
    source = FileSampleSource([str(path)], SPEC, start={0: 2500}, chunk_rows=700)
    pre = Prefetcher(source, SPEC, 256, history_len=50).start()
    rest = []
    while (item := pre.get(timeout=10)) is not END:
        rest += item.event_ids.to_pylist()
    pre.stop()
    assert rest == [e for i, e in enumerate(small["event_id"].to_pylist()) if i >= 2500 and labels[i] != 5]


class _TrickleSource:
    """A topic under light load: a few fresh samples every 50 ms, never a quiet poll."""

    def __init__(self, table):
        self.table = table

    def chunks(self):
        import time

        from streamrec.trainer.sources import SampleChunk

        for start in range(0, self.table.num_rows, 10):
            time.sleep(0.05)
            part = self.table.slice(start, 10)
            rows = np.arange(start, start + part.num_rows)
            yield SampleChunk(part, np.zeros(len(rows), np.int64), rows, {0: start + part.num_rows})

    def lag(self):
        return None

    def commit(self, positions):
        pass

    def close(self):
        pass


def test_a_partial_batch_is_trained_once_its_oldest_sample_waited_max_delay(table):
    """Samples that trickle in are not held back for a full batch, even though every poll
    brings some: the oldest waits about max_delay, and positions still count every row."""
    pre = Prefetcher(_TrickleSource(table.slice(0, 2000)), SPEC, 1000, history_len=50, max_delay_s=0.2).start()
    first = pre.get(timeout=5)  # a full batch would take 5 s of trickle
    pre.stop()
    assert not isinstance(first, str) and 0 < len(first) < 1000, first
    assert first.positions == {0: len(first)}


def _cfg(tmp_path, **extra):
    overrides = {"trainer.model_store": str(tmp_path / "models"), "trainer.work_dir": str(tmp_path / "work"),
                 "trainer.progress_interval_s": 3600.0, "trainer.device": "auto", **extra}
    return load_config(overrides=overrides, environ={})


@pytest.mark.parametrize("full_every, compact_every", [(2, 0), (1000, 2)], ids=["fulls", "compacted-deltas"])
def test_published_version_equals_the_trainers_parameters(tmp_path, sample_run, full_every, compact_every):
    cfg = _cfg(tmp_path, **{"trainer.publish_interval_s": 0.2, "trainer.full_every": full_every, "trainer.warmup_samples": 10**9,
                            "trainer.compact_every": compact_every, "trainer.keep_fulls": 2})
    trainer = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=30000, progress=False))
    summary = trainer.run()
    assert len(summary["published"]) >= 3 and {r["kind"] for r in summary["published"]} == {"full", "delta"}
    ms = ModelStore(str(tmp_path / "models"), "ctr")
    if compact_every:  # the chain was compacted in the background and old versions deleted
        kinds = [r["kind"] for r in summary["published"]]
        assert kinds.count("full") == 1 and len(summary["compactions"]) >= 2, summary["compactions"]
        assert len(ms.images()) == 2 and min(ms.versions()) > 1
        assert len(ms.chain(ms.latest())) <= compact_every + 2
    loaded = InferenceModel.load(ms)
    assert loaded.version == ms.latest() == summary["version"]
    restored, _ = EmbeddingCollection.restore(trainer.session.checkpointer.latest() / "sparse")
    for name, table_ in restored.tables.items():  # the final checkpoint holds the trainer's final rows
        keys, values = [], []
        for k, w in table_.export_all():
            keys.append(k)
            values.append(w)
        keys, values = torch.cat(keys), torch.cat(values)
        _, got, absent = loaded.embeddings[name].export(keys)
        assert len(absent) == 0, name
        assert torch.equal(got, values), name
        assert len(loaded.embeddings[name]) == len(keys)
    state = torch.load(trainer.session.checkpointer.latest() / "dense.pt", map_location="cpu", weights_only=False)["model"]
    for key, value in state.items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
    restored.close()
    loaded.close()


def test_bad_files_and_locks_give_clear_errors(tmp_path, sample_run):
    cfg = _cfg(tmp_path)
    with pytest.raises(FileNotFoundError, match="no sample file"):
        Trainer(cfg, TrainOptions(files=[str(tmp_path / "nope")], progress=False))
    first = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=2000, progress=False))
    with pytest.raises(TrainingError, match="another trainer is running"):
        Trainer(cfg, TrainOptions(files=[str(sample_run)], progress=False))
    first.close()
    Trainer(cfg, TrainOptions(files=[str(sample_run)], progress=False)).close()  # closed, the lock is free again


@pytest.mark.parametrize("from_topic, env, named", [
    (True, {}, "was trained from files:"),  # the samples topic, where files trained the checkpoint
    (False, {"STREAMREC_MODEL__EMBEDDING_DIM": "8"}, "has model spec"),
], ids=["another_source", "another_model_spec"])
def test_a_checkpoint_of_another_source_or_model_spec_is_refused_naming_fresh(published_model, sample_run, tmp_path, from_topic,
                                                                              env, named):
    """Resuming must never mix a checkpoint with another source's positions or another
    model's shapes: `streamrec train` refuses at start, with one line that names --fresh and
    no traceback, and leaves the checkpoints as they were; with --fresh it then starts over.
    The checkpoint is a copy of the session trainer's last (conftest's ``published_model``,
    whose work dir is next to its store)."""
    models, _ = published_model
    store, work = copy_store(models, tmp_path / "models"), Path(shutil.copytree(models.parent / "work", tmp_path / "work"))
    checkpoints = Checkpointer(work / "ctr" / "checkpoints")
    held, latest = checkpoints.steps(), checkpoints.latest()
    assert held and latest is not None
    args = ["train", "--model-store", str(store), "--work-dir", str(work), "--device", "cpu", "--no-frozen", "--no-announce",
            *([] if from_topic else ["--samples", str(sample_run)])]
    refused = run_cli(*args, env=env, timeout=300)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert named in refused.stderr and "--fresh" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert checkpoints.steps() == held and checkpoints.latest() == latest
    if not from_topic:  # the advice works: --fresh moves the checkpoints aside and trains (the topic is not this test's)
        fresh = run_cli(*args, "--fresh", "--max-samples", "1", env=env, timeout=300)
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        assert len(list((work / "ctr").glob("checkpoints.old-*"))) == 1 and checkpoints.latest() != latest


def _assert_every_version_finite(ms: ModelStore) -> None:
    for version in ms.versions():
        _, sparse, dense = ms.read_version(version)
        assert all(torch.isfinite(v).all() for v in dense.values())
        for t in sparse.values():
            assert np.isfinite(pc.list_flatten(t["value"]).to_numpy()).all()


def test_a_run_that_fails_on_bad_input_releases_the_trainer(tmp_path, sample_run):
    """A sample file the trainer cannot read stops it with the reason; the lock, lease and
    scratch tiers are released, so the next run (with good files) starts and trains."""
    table = pq.read_table(sample_run / "samples.parquet").slice(0, 5000).drop_columns(["hist_item_ids"])
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError, match=r"samples lack columns \['hist_item_ids'\]"):
        Trainer(cfg, TrainOptions(files=[str(bad)], progress=False)).run()
    assert not list((tmp_path / "work" / "ctr").glob("tiers-*"))
    summary = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=2000, progress=False)).run()
    assert summary["samples_this_run"] >= 2000


def test_steady_throughput_counts_from_the_warm_up_and_the_heap_is_frozen_only_during_the_run(tmp_path, sample_run):
    """The summary's steady throughput is the samples trained after the warm-up steps over
    the time they took; the run freezes the heap (full collections skip what it holds) and
    thaws it when it ends, for the process that goes on."""
    batch = 64
    trainer = Trainer(_cfg(tmp_path, **{"trainer.batch_size": batch}),
                      TrainOptions(files=[str(sample_run)], max_samples=batch * (WARM_UP_STEPS + 40), progress=False))
    summary = trainer.run()
    loop = trainer.loop
    assert summary["step"] >= WARM_UP_STEPS + 40
    (warmed_at, warmed_samples), (ended_at, samples) = loop.warmed, loop.last_step
    assert warmed_samples == batch * WARM_UP_STEPS and samples == summary["samples"]
    assert summary["steady_samples_per_s"] == pytest.approx((samples - warmed_samples) / (ended_at - warmed_at))
    assert summary["gc"]["frozen_objects"] > 10_000  # torch's modules at least
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("dense_lr, sparse_lr, cause", [
    (1e30, 1e30, "loss became nan at step 1"),  # nothing good to publish first
    (0.005, 1e10, "loss became nan at step"),  # good versions first, then the loss (step 7 here)
])
def test_a_nan_loss_stops_training_and_publishes_nothing_poisoned(tmp_path, sample_run, dense_lr, sparse_lr, cause):
    cfg = _cfg(tmp_path, **{"model.dense_lr": dense_lr, "model.sparse_lr": sparse_lr, "trainer.publish_interval_s": 0.05,
                            "trainer.warmup_samples": 10**9})
    with pytest.raises(TrainingError, match=f"{cause}.*last good version") as err:
        train(cfg, TrainOptions(files=[str(sample_run)], max_samples=100000, progress=False))
    ms = ModelStore(str(tmp_path / "models"), "ctr")
    # the error names the store's LATEST as the last good version; where versions were
    # published before it went wrong, each of them is checked below (not an empty loop)
    assert f"the last good version is {ms.latest() or 'none'}" in str(err.value)
    assert (ms.latest() is None) == (dense_lr == 1e30) and ms.versions()[-1:] == ([ms.latest()] if ms.latest() else [])
    _assert_every_version_finite(ms)


def test_a_publish_refuses_non_finite_embeddings_the_loss_never_saw(tmp_path, sample_run):
    """A row can go non-finite without any batch reading it, so the loss stays finite: the
    publish is the last guard. The poisoned row is planted after a good run, so which guard
    fires does not depend on when a publish happens to fall."""
    cfg = _cfg(tmp_path, **{"trainer.publish_interval_s": 0.05, "trainer.warmup_samples": 10**9})
    train(cfg, TrainOptions(files=[str(sample_run)], max_samples=20000, progress=False))
    ms = ModelStore(str(tmp_path / "models"), "ctr")
    good = ms.latest()
    assert good is not None
    trainer = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=20000, progress=False))
    table = trainer.session.embeddings["item"]
    key = torch.tensor([2**62])  # no sample carries this id: no loss reads the row
    table.load_rows(key, torch.full((1, table.config.dim), float("inf")))
    touched, deleted = table.tracking.tracked()
    table.tracking.set_tracked(torch.cat([touched, key]), deleted)
    with pytest.raises(TrainingError, match="table item holds non-finite embedding values.*last good version") as err:
        trainer.run()
    assert f"the last good version is {good}" in str(err.value)
    assert ms.latest() == good and ms.versions()[-1] == good
    _assert_every_version_finite(ms)


def test_sigterm_publishes_checkpoints_and_exits_cleanly(tmp_path, sample_run):
    """A stop signal finishes the step, publishes what was trained, checkpoints, exits 0."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "train", "--samples", str(sample_run), "--model-store",
                             str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"), "--publish-interval", "0.5",
                             "--batch-size", "256", "--device", "cpu", "--json"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = ModelStore(str(tmp_path / "models"), "ctr")
    deadline = time.monotonic() + 120
    while store.latest() is None:  # training is under way: its first version is out
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no version within 120 s"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    state = json.loads((Checkpointer(tmp_path / "work" / "ctr" / "checkpoints").latest() / "state.json").read_text())
    manifest = store.manifest(store.latest())
    rows = pq.ParquetFile(sample_run / "samples.parquet").metadata.num_rows
    assert 0 < summary["samples"] < rows, (summary["samples"], rows)  # the signal, not the end of the file, stopped it
    assert state["samples"] == manifest["samples_trained"] == summary["samples"]  # everything trained is published
    assert state["positions"] == manifest["offsets"] == {"0": summary["samples"]}
    assert not list((tmp_path / "work" / "ctr").glob("tiers-*"))  # the run's scratch tiers are gone


def _final_training_state(work: Path) -> tuple[dict[str, list[torch.Tensor]], dict, dict]:
    """From the last checkpoint under ``work`` (one rank): each table's rows sorted by key
    (keys, weights, optimizer state, clocks), the dense model and its Adam state, state.json."""
    ckpt = Checkpointer(work / "ctr" / "checkpoints").latest()
    store, _ = EmbeddingCollection.restore(ckpt / "sparse")
    try:
        rows = {}
        for name, table in store.tables.items():
            keys, weights, state, seen = (torch.cat(parts) for parts in zip(*table.export_all(with_state=True)))
            order = torch.argsort(keys)
            rows[name] = [keys[order], weights[order], state[order], seen[order]]
    finally:
        store.close()
    return rows, torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=False), json.loads((ckpt / "state.json").read_text())


def test_a_run_killed_and_resumed_ends_with_exactly_the_parameters_of_an_unbroken_one(published_model, sample_run, tmp_path):
    """docs/trainer.md: training is a function of the data alone. `streamrec train` over the
    samples the session's unbroken run trained (conftest's ``published_model``, whose final
    checkpoint is the reference) is killed with SIGKILL inside a publish that follows a
    checkpoint with samples in it (tests/pause_points.py), so the steps since are lost; run
    again, it resumes from that checkpoint and ends with the unbroken run's rows (weights,
    optimizer state, clocks) and dense model and Adam state, bit for bit."""
    import signal
    import subprocess
    import time

    import pause_points
    from conftest import REPO

    models, _ = published_model
    want_rows, want_dense, want_state = _final_training_state(models.parent / "work")
    read = want_state["positions"]["0"]  # rows of the file the unbroken run read: its samples, in its batches
    assert want_state["samples"] > 0
    samples = tmp_path / "samples.parquet"
    pq.write_table(pq.read_table(sample_run / "samples.parquet").slice(0, read), samples)
    work, arm = tmp_path / "work", tmp_path / "arm"
    args = ("train", "--samples", str(samples), "--model-store", str(tmp_path / "models"), "--work-dir", str(work), "--device", "cpu",
            "--no-frozen", "--no-announce", "--publish-interval", "1", "--checkpoint-interval", "0.2")
    checkpoints = Checkpointer(work / "ctr" / "checkpoints")
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(pause_points.streamrec_argv(*args), cwd=REPO, env=pause_points.child_env(arm),
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 300
            while not any(step > 0 for step in checkpoints.steps()):  # a checkpoint with samples in it
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint with samples within 300 s"
                time.sleep(0.02)
            pause_points.arm(arm, "manifest")
            staged = json.loads(Path(pause_points.wait_paused(arm, proc)["path"]).read_text())
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    resumes_from = checkpoints.latest()
    at_kill = json.loads((resumes_from / "state.json").read_text())
    # no checkpoint is written while a publish is in flight: the steps up to the one being published are lost
    assert 0 < at_kill["samples"] < staged["samples_trained"] <= want_state["samples"], (at_kill["samples"], staged["samples_trained"])

    resumed = run_cli(*args, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {resumes_from.name}" in resumed.stderr, resumed.stderr[-3000:]
    rows, dense, state = _final_training_state(work)
    assert (state["step"], state["samples"], state["positions"]) == (want_state["step"], want_state["samples"], want_state["positions"])
    assert rows.keys() == want_rows.keys()
    for name, want in want_rows.items():
        assert len(want[0]) > 0, name
        for what, got, expected in zip(("keys", "weights", "optimizer state", "clocks"), rows[name], want):
            assert torch.equal(got, expected), (name, what)
    assert dense["model"].keys() == want_dense["model"].keys()
    for key, value in want_dense["model"].items():
        assert torch.equal(dense["model"][key], value), key
    for param, want in want_dense["optimizer"]["state"].items():
        for key, value in want.items():
            assert torch.equal(torch.as_tensor(dense["optimizer"]["state"][param][key]), torch.as_tensor(value)), (param, key)
