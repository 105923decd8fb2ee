"""Training across nodes, in the form CI runs it: two torchrun launchers on this machine, one
rank each (``--nnodes 2``, a c10d rendezvous on localhost, a node-local work dir each), train
one model together over gloo. The version they publish loads as serving loads it, holds every
sample of the run, and equals, bit for bit, what one launcher with two ranks
(``--nproc-per-node 2``: conftest's ``two_ranks_run``) publishes from the same samples."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, free_port, run_cli
from streamrec.model.batch import batch_from_table
from streamrec.model.inference import InferenceModel
from streamrec.modelstore.store import ModelStore

# one thread per rank, as the local launcher gives conftest's run, so their float sums agree to the last bit
ENV = {"OMP_NUM_THREADS": "1", "STREAMREC_TRAINER__COLLECTIVE_TIMEOUT_S": "60"}


def _train_args(run: Path, store: Path, work: Path) -> list[str]:
    """`streamrec train`'s arguments: every sample of ``run``, 512 per rank and step, one version at the end."""
    return ["train", "--samples", str(run), "--batch-size", "512", "--device", "cpu", "--no-frozen", "--no-announce", "--json",
            "--publish-interval", "3600", "--model-store", str(store), "--work-dir", str(work)]


def _two_launchers(run: Path, root: Path) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2 --nproc-per-node 1`` twice, as two hosts would start it: one
    rendezvous endpoint (the first launcher to reach it hosts the c10d store), one model
    store, a work dir of each node's own."""
    port, rdzv_id = free_port(), f"ci-{uuid.uuid4().hex[:8]}"
    launchers = []
    for node in ("node-a", "node-b"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--max-restarts", "0",
               "-m", "streamrec.cli", *_train_args(run, root / "models", root / node)]
        launchers.append(subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
    done = []
    try:
        for launcher in launchers:
            out, err = launcher.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    return done


@pytest.mark.slow
def test_two_launchers_train_one_model_as_two_local_ranks_do(same_steps_run, two_ranks_run, tmp_path):
    """The steps of one launcher's two ranks (conftest's run, on the same samples and batches):
    the version equals theirs bit for bit, and serving's loader scores it as it scores theirs."""
    rows = pq.ParquetFile(same_steps_run).metadata.num_rows
    nodes = _two_launchers(same_steps_run, tmp_path / "nodes")
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    # rank 0 (on whichever launcher the rendezvous made node 0) reports for both
    printed = [node.stdout for node in nodes if node.stdout.strip()]
    assert len(printed) == 1, [node.stdout[-500:] for node in nodes]
    summary = json.loads(printed[0])
    assert summary["world_size"] == 2 and summary["samples"] == rows
    assert sorted(r["samples"] for r in summary["ranks"]) == sorted(r["samples"] for r in summary["step_by_rank"])
    assert sum(r["samples"] for r in summary["ranks"]) == rows and min(r["samples"] for r in summary["ranks"]) > 0
    # each node kept its own rank's checkpoints in its own work dir
    held = {node: sorted(p.name for p in (tmp_path / "nodes" / node / "ctr" / "checkpoints").iterdir()) for node in ("node-a", "node-b")}
    assert sorted(sum(held.values(), [])) == ["rank-00000-of-00002", "rank-00001-of-00002"], held

    local_dir, local = two_ranks_run
    assert local["samples"] == rows
    stores = {"nodes": ModelStore(str(tmp_path / "nodes" / "models"), "ctr"), "local": ModelStore(str(local_dir / "models"), "ctr")}
    assert stores["nodes"].versions() == [1] and stores["nodes"].manifest(1)["shards"] == 2
    a, b = (stores[name].load() for name in ("nodes", "local"))
    assert a.tables.keys() == b.tables.keys() and a.dense.keys() == b.dense.keys()
    for name, (keys, values) in a.tables.items():
        want_keys, want_values = b.tables[name]
        order, want_order = np.argsort(keys), np.argsort(want_keys)
        assert len(keys) > 0 and np.array_equal(keys[order], want_keys[want_order]), name
        assert np.array_equal(values[order], want_values[want_order]), name
    for name, value in a.dense.items():
        assert torch.equal(value, b.dense[name]), name

    # serving's loader reads the two nodes' version and scores as the local ranks' version does
    served, reference = (InferenceModel.load(stores[name], device="cpu") for name in ("nodes", "local"))
    instances = pq.read_table(same_steps_run).slice(1000, 64)
    batch = batch_from_table(instances, served.feature_spec, served.model.spec.history_len)
    scores = served.predict(batch, batch.max_ts())
    assert served.version == 1 and np.isfinite(scores).all() and scores.std() > 0
    assert np.array_equal(scores, reference.predict(batch, batch.max_ts()))


def test_train_under_torchrun_refuses_a_launcher_of_its_own(tmp_path):
    """``--nproc-per-node`` inside a rank that torchrun started would start ranks inside each
    rank: refused, naming what to do, before anything is read or written."""
    done = run_cli(*_train_args(tmp_path / "run", tmp_path / "models", tmp_path / "work"), "--nproc-per-node", "2",
                   env={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"}, timeout=120)
    assert done.returncode != 0 and "give --nproc-per-node to torchrun" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "models").exists() and not (tmp_path / "work").exists()
