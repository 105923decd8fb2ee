"""The trainer's input pipeline in a child process (trainer/decode_process.py): the same
batches, positions and rejects as the decoding thread, the same training, and clear
failures (a bad file, a killed child, a killed trainer)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO
from model.batch import SampleBatch
from model.inference import InferenceModel
from pipelines.feature_spec import FeatureSpec
from ps.model_store import ModelStore
from streamrec.config import ConfigError, load_config
from trainer.decode_process import DecodeProcess
from trainer.engine import Trainer, TrainOptions
from trainer.prefetch import END, IDLE, Prefetcher, Skipped
from trainer.sources import SourceRecipe

SPEC = FeatureSpec()


@pytest.fixture(scope="module")
def file_with_rejects(sample_run, tmp_path_factory):
    """6,000 samples, three of them refused (one the very last row)."""
    table = pq.read_table(sample_run / "samples.parquet").slice(0, 6000)
    labels = table["label"].to_numpy().copy()
    labels[[7, 2500, 5999]] = 5
    path = tmp_path_factory.mktemp("decode") / "s.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int8())), path)
    return path


def _items(prefetcher) -> list:
    out = []
    while (item := prefetcher.get(timeout=60)) is not END:
        assert item is not IDLE
        out.append(item)
    prefetcher.stop()
    return out


def test_the_process_hands_out_the_threads_batches_positions_and_rejects(file_with_rejects):
    recipe = SourceRecipe(SPEC, {0: 700}, files=(str(file_with_rejects),))  # resumed mid-file
    threaded = _items(Prefetcher(recipe.open(), SPEC, 333, history_len=50).start())
    worker = DecodeProcess(recipe, 333, 50, depth=3).start()
    spawned = _items(worker)
    assert worker.lag() == 0  # the file is read to its end
    assert len(spawned) == len(threaded) > 10
    assert sum(isinstance(i, SampleBatch) for i in spawned) == len(spawned)  # the last reject rides with the last batch
    for a, b in zip(spawned, threaded):
        assert (a.positions, a.rejected, a.history_len) == (b.positions, b.rejected, b.history_len)
        assert a.event_ids.equals(b.event_ids)
        for name in b._tensors():
            assert getattr(a, name).dtype == getattr(b, name).dtype and torch.equal(getattr(a, name), getattr(b, name)), name
    assert sum((a.rejected for a in spawned), start=type(spawned[0].rejected)()) == {"invalid_value": 2}  # row 7 is before 700
    assert spawned[-1].positions == {0: 6000}


def test_only_rejected_rows_come_back_as_skipped(file_with_rejects, tmp_path):
    table = pq.read_table(file_with_rejects).slice(0, 50)
    labels = np.full(50, 9, np.int8)
    path = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels)), path)
    items = _items(DecodeProcess(SourceRecipe(SPEC, {}, files=(str(path),)), 16, 50).start())
    assert len(items) == 1 and isinstance(items[0], Skipped)
    assert items[0].positions == {0: 50} and items[0].rejected == {"invalid_value": 50}


def test_a_missing_file_fails_at_start_with_its_own_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sample file") as caught:
        DecodeProcess(SourceRecipe(SPEC, {}, files=(str(tmp_path / "none.parquet"),)), 64, 50).start()
    assert "decode process" in "".join(caught.value.__notes__)


def test_a_killed_decode_process_is_reported_not_waited_for(file_with_rejects):
    worker = DecodeProcess(SourceRecipe(SPEC, {}, files=(str(file_with_rejects),), loop=True), 64, 50, depth=2).start()
    assert isinstance(worker.get(timeout=60), SampleBatch)
    os.kill(worker._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"decode process died \(exit code -9\)"):
        for _ in range(1000):  # the batches already handed over come first
            worker.get(timeout=30)
    worker.stop()


def test_the_decode_process_stops_when_its_trainer_is_killed(file_with_rejects, tmp_path):
    script = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
              "from pipelines.feature_spec import FeatureSpec\n"
              "from trainer.decode_process import DecodeProcess\n"
              "from trainer.sources import SourceRecipe\n"
              "if __name__ == '__main__':\n"
              f"    w = DecodeProcess(SourceRecipe(FeatureSpec(), {{}}, files=({str(file_with_rejects)!r},), loop=True), 64, 50).start()\n"
              "    print(w._process.pid, flush=True)\n"
              "    time.sleep(600)\n")
    (tmp_path / "parent.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()  # SIGKILL: no clean-up of its own
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the decode process outlived its trainer by 20 s")


def _train(tmp_path, sample_run, mode):
    cfg = load_config(overrides={"trainer.model_store": str(tmp_path / mode / "models"), "trainer.work_dir": str(tmp_path / mode / "work"),
                                 "trainer.progress_interval_s": 3600.0, "trainer.device": "cpu", "trainer.decode_process": mode,
                                 "trainer.batch_size": 512, "trainer.warmup_samples": 10**9}, environ={})
    summary = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=8192, progress=False)).run()
    return summary, ModelStore(str(tmp_path / mode / "models"), "ctr")


def test_a_trainer_decoding_in_a_process_trains_exactly_what_a_thread_trains(tmp_path, sample_run):
    (thread, thread_store), (process, process_store) = (_train(tmp_path, sample_run, m) for m in ("thread", "process"))
    trained = thread["samples_this_run"]
    assert trained >= 8192 and process["samples_this_run"] == trained
    assert thread["auc_online"] == process["auc_online"]
    a, b = InferenceModel.load(thread_store), InferenceModel.load(process_store)
    assert a.manifest["offsets"] == b.manifest["offsets"] == {"0": trained}
    for key, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[key]), key
    for name, table in a.store.tables.items():
        keys = torch.cat([k for k, _ in table.iter_rows()])
        assert len(b.store[name]) == len(keys)
        assert torch.equal(table.read(keys)[1], b.store[name].read(keys)[1]), name
    a.close()
    b.close()


def test_an_unknown_decode_mode_is_refused():
    with pytest.raises(ConfigError, match="trainer.decode_process must be one of auto, thread, process"):
        load_config(overrides={"trainer.decode_process": "fork"}, environ={})
