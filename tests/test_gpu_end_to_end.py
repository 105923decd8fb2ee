"""CUDA end to end, run on a GPU machine with ``pytest -m gpu`` (skipped without CUDA): the
real trainer on a GPU (graphed dense step, fused Adam) learns and publishes versions that
load; two GPU ranks over NCCL learn as one GPU does (2 GPUs); serving's ``graph``,
``compile`` and ``compile+graph`` buckets score as the eager model, before and after a delta
applied in place; a real ``streamrec serve --device cuda`` process answers over HTTP as the
eager model does, also while deltas are applied under load with its CUDA graphs replaying.

The references are the eager model on the CPU, of the versions the session's CPU trainer
published (conftest's ``published_model``): what a node on a GPU serves must be what the
trainer's model says, whatever device either ran on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, free_port, run_cli, wait_ready
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.batch import SampleBatch, batch_from_table
from streamrec.model.inference import InferenceModel
from streamrec.model.metrics import auc, logloss
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.config import load_config
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.runtime.state import ServedModel
from streamrec.trainer.dense_graph import GraphedDense
from streamrec.trainer.driver import Trainer, TrainOptions
from test_serving_http import call, first_two_versions, publish_in_turn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPEC = FeatureSpec()
N_INSTANCES = 64
# scores (probabilities) on the GPU against the eager model on the CPU: the two devices' float32
# kernels sum in other orders (1.2e-7 apart on an H200, 2026-11)
CUDA_VS_CPU_ATOL = 1e-6
# a bucket against the eager model on the same GPU (docs/serving.md, "Shape buckets"): graphs
# were bit for bit equal, torch.compile's fused kernels 1.2e-7 apart (H200, 2026-11)
SAME_DEVICE_ATOL = 5e-7
TRAINED = 120_000  # samples the GPU trainer trains; the rows from HELD_OUT on it never sees
HELD_OUT = 140_000


@pytest.fixture(scope="module")
def instances(sample_run) -> pa.Table:
    """64 instances from the middle of the run (users with histories), without their labels."""
    return pq.read_table(sample_run / "samples.parquet").slice(60_000, N_INSTANCES).drop(["label", "click_ts"])


@pytest.fixture(scope="module")
def expected(published_model, instances) -> dict[int, np.ndarray]:
    """Every version's scores of ``instances``, by the eager model on the CPU."""
    root, versions = published_model
    batch = batch_from_table(instances, SPEC, 50, with_labels=False)
    out = {}
    for v in versions:
        model = InferenceModel.load(ModelStore(str(root), "ctr"), v, "cpu")
        out[v] = model.predict(batch)
        model.close()
    return out


def _batch(instances: pa.Table, rows: slice) -> SampleBatch:
    return batch_from_table(instances.slice(rows.start, rows.stop - rows.start), SPEC, 50, with_labels=False)


# ---------------------------------------------------------------- the trainer on a GPU
def test_the_trainer_learns_on_cuda_through_its_graphed_dense_step_and_fused_adam(sample_run, tmp_path, monkeypatch):
    """The real Trainer with ``trainer.device = cuda``: every step (all full batches) replays
    the captured dense graphs, counted where GraphedDense calls them; the dense optimizer is
    fused Adam (its step counters live on the device); it learns (online AUC above chance,
    log loss below the best constant's); its versions form a chain that loads on the GPU and
    scores held-out samples as on the CPU, better than chance."""
    cfg = load_config(overrides={"trainer.model_store": str(tmp_path / "models"), "trainer.work_dir": str(tmp_path / "work"),
                                 "trainer.publish_interval_s": 0.3, "trainer.full_every": 1000, "trainer.frozen_baseline": False,
                                 "trainer.progress_interval_s": 3600.0, "trainer.device": "cuda"}, environ={})
    trainer = Trainer(cfg, TrainOptions(files=[str(sample_run)], max_samples=TRAINED, progress=False))
    graphed = trainer.loop.forward
    assert isinstance(graphed, GraphedDense)
    replays = 0
    captured = graphed._graphed

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return captured(*args)

    monkeypatch.setattr(graphed, "_graphed", counted)
    optimizer = trainer.session.optimizer
    summary = trainer.run()

    batch_size = cfg.trainer.batch_size
    assert summary["device"] == "cuda" and summary["samples"] >= TRAINED
    assert summary["samples"] == summary["step"] * batch_size and replays == summary["step"]  # full batches, all graphed
    assert all(group["fused"] for group in optimizer.param_groups)
    assert optimizer.state and all(state["step"].is_cuda for state in optimizer.state.values())

    labels = pq.read_table(sample_run / "samples.parquet", columns=["label"])["label"].to_numpy()
    window = labels[summary["samples"] - summary["window_rows"]:summary["samples"]]
    constant = logloss(np.full(len(window), window.mean()), window)  # the best constant score's, over the same rows
    print({k: summary[k] for k in ("step", "auc_online", "logloss_online")}, {"logloss_constant": constant})
    assert summary["auc_online"] > 0.6 and summary["logloss_online"] < constant

    store = ModelStore(str(tmp_path / "models"), "ctr")
    versions = store.versions()
    assert len(versions) >= 2 and [r["version"] for r in summary["published"]] == versions
    assert store.manifest(versions[0])["kind"] == "full" and all(store.manifest(v)["kind"] == "delta" for v in versions[1:])
    held_out = pq.read_table(sample_run / "samples.parquet").slice(HELD_OUT, 20_000)
    batch = batch_from_table(held_out, SPEC, 50)
    on_gpu, on_cpu = (InferenceModel.load(store, versions[-1], device) for device in ("cuda", "cpu"))
    scores = on_gpu.predict(batch)
    held_out_auc, apart = auc(scores, held_out["label"].to_numpy()), float(np.abs(scores - on_cpu.predict(batch)).max())
    print({"held_out_auc": held_out_auc, "cuda_vs_cpu": apart})
    assert on_gpu.version == versions[-1] and held_out_auc > 0.6 and apart <= CUDA_VS_CPU_ATOL
    on_gpu.close()
    on_cpu.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_over_nccl_learn_as_one_gpu_does(sample_run, tmp_path):
    """``streamrec train --nproc-per-node 2 --device cuda``: one rank per GPU, sharded
    embeddings exchanged and dense gradients averaged over NCCL. The same 1,024 samples a step
    (row groups of 512: each rank's batch is a whole group) as one GPU at batch 1,024: every
    sample trained, online AUC within 0.01 of one GPU's (the GPUs' atomics sum in any order),
    rows crossed between the ranks, and the two-shard version loads and scores on a GPU."""
    path = tmp_path / "samples.parquet"
    pq.write_table(pq.read_table(sample_run / "samples.parquet").slice(0, 48 * 1024), path, row_group_size=512)
    rows = pq.ParquetFile(path).metadata.num_rows

    def train(name: str, *extra: str) -> dict:
        done = run_cli("train", "--samples", str(path), "--model-store", str(tmp_path / name / "models"), "--work-dir",
                       str(tmp_path / name / "work"), "--device", "cuda", "--no-frozen", "--no-announce", "--publish-interval", "3",
                       "--json", *extra, env={"STREAMREC_TRAINER__EVAL_WINDOW": "1000000"}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    one = train("one", "--batch-size", "1024")
    two = train("two", "--batch-size", "512", "--nproc-per-node", "2")
    print({"auc_one": one["auc_online"], "auc_two": two["auc_online"]})
    assert one["samples"] == two["samples"] == rows and two["world_size"] == 2
    assert sorted(r["samples"] for r in two["step_by_rank"]) == sorted(r["samples"] for r in two["ranks"])
    assert sum(r["samples"] for r in two["ranks"]) == rows and min(r["samples"] for r in two["ranks"]) > 0
    assert abs(one["auc_online"] - two["auc_online"]) < 0.01
    assert all(r["exchange"]["bytes_out"]["rows"] > 0 and r["exchange"]["ids_received"] > 0 for r in two["step_by_rank"])
    store = ModelStore(str(tmp_path / "two" / "models"), "ctr")
    assert store.manifest(store.versions()[-1])["shards"] == 2
    model = InferenceModel.load(store, device="cuda")
    held_out = pq.read_table(sample_run / "samples.parquet").slice(HELD_OUT, 20_000)
    scores = model.predict(batch_from_table(held_out, SPEC, 50))
    assert np.isfinite(scores).all() and auc(scores, held_out["label"].to_numpy()) > 0.6
    model.close()


# ---------------------------------------------------------------- serving's buckets on a GPU, in process
@pytest.mark.parametrize("mode", ["graph", "compile", "compile+graph"])
def test_bucket_modes_on_cuda_score_as_the_eager_model_before_and_after_a_delta(mode, published_model, instances, expected):
    """Each mode's buckets, built at load on 2 worker streams, score batches of several sizes
    and history lengths as the eager model on the same GPU and on the CPU, for the full
    version and for the delta after it applied in place (the buckets read the weights it
    copied into their parameters); every batch ran in a bucket, none eagerly."""
    root, versions = published_model
    store = ModelStore(str(root), "ctr")
    served = ServedModel(store, "cuda", runtime=RuntimeConfig(mode, (16, 64), (16,), max_extra=0, workers=2))
    eager = ServedModel(store, "cuda", runtime=None)
    worst = {"cpu": 0.0, "eager_cuda": 0.0}
    try:
        reports = []
        for version in versions[:2]:
            reports.append(served.load(version).mode)
            eager.load(version)
            for rows in (slice(0, 3), slice(3, 19), slice(0, N_INSTANCES)):
                batch = _batch(instances, rows)
                got_version, got = served.predict(batch)
                assert got_version == version
                reference = eager.predict(batch)[1]
                worst["cpu"] = max(worst["cpu"], float(np.abs(got - expected[version][rows]).max()))
                worst["eager_cuda"] = max(worst["eager_cuda"], float(np.abs(got - reference).max()))
        print(f"{mode}: largest difference from the eager model on the CPU {worst['cpu']:.2e}, "
              f"on the same GPU {worst['eager_cuda']:.2e}")
        assert reports == ["swap", "delta"]
        assert worst["cpu"] <= CUDA_VS_CPU_ATOL and worst["eager_cuda"] <= SAME_DEVICE_ATOL, worst
        stats = served.current.runner.stats.as_json()
        assert stats["mode"] == mode and stats["compiled_buckets"] == 4 and stats["eager_batches"] == 0
        assert sum(b["batches"] for b in stats["buckets"].values()) == 6  # the delta, applied in place, kept the buckets
    finally:
        served.close()
        eager.close()


# ---------------------------------------------------------------- `streamrec serve --device cuda` over HTTP
@pytest.fixture(scope="module")
def cuda_server(published_model, tmp_path_factory) -> Iterator[tuple[str, Path, list[int]]]:
    """``streamrec serve --device cuda --compile graph --workers 2`` on a copy of the store
    holding the first two versions, batches of at most 64 instances (every one fits a
    bucket: nothing runs eagerly); yields (base URL, store root, the published versions)."""
    root, versions = published_model
    store_root = first_two_versions(root, versions, tmp_path_factory.mktemp("cuda_serving") / "models")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store_root), "--port", str(port), "--device", "cuda",
         "--poll-interval", "0.2", "--compile", "graph", "--workers", "2"],
        cwd=REPO, env={**os.environ, "STREAMREC_SERVING__FEATURE_STORE": "false", "STREAMREC_SERVING__FOLLOW_UPDATES": "false",
                       "STREAMREC_SERVING__MAX_BATCH": "64", "STREAMREC_SERVING__BATCH_BUCKETS": "8,16,64", "STREAMREC_SERVING__HISTORY_BUCKETS": "16"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, 180)
        yield base, store_root, versions
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
        print(out[-5000:])  # the server's log, shown when a test fails
    assert proc.returncode == 0  # graceful shutdown on SIGTERM


def test_serve_on_cuda_answers_as_the_eager_cpu_model(cuda_server, instances, expected):
    """Concurrent requests (merged by the batcher) and a whole 64-instance one, served from
    CUDA graphs: the version served, the eager CPU model's scores; the graphs replayed them."""
    base, _, versions = cuda_server
    rows = instances.to_pylist()
    results: dict[int, tuple[int, dict]] = {}

    def client(i: int) -> None:
        results[i] = call(base, "POST", "/v1/models/ctr:predict", {"instances": rows[i * 8:(i + 1) * 8]})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results[8] = call(base, "POST", "/v1/models/ctr:predict", {"instances": rows})
    want, apart = expected[versions[1]], 0.0
    for i, (status, body) in results.items():
        assert status == 200 and body["model_version"] == versions[1], body
        sl = slice(0, N_INSTANCES) if i == 8 else slice(i * 8, (i + 1) * 8)
        apart = max(apart, float(np.abs(np.asarray(body["scores"]) - want[sl]).max()))
    print(f"served on CUDA: largest difference from the eager model on the CPU {apart:.2e}")
    assert apart <= CUDA_VS_CPU_ATOL
    runtime = call(base, "GET", "/v1/models/ctr")[1]["runtime"]
    assert runtime["mode"] == "graph" and runtime["eager_batches"] == 0, runtime
    assert sum(b["batches"] for b in runtime["buckets"].values()) >= 2, runtime


def test_deltas_applied_while_cuda_graphs_replay_answer_one_version_or_the_next(cuda_server, published_model, instances, expected):
    """Clients keep requests in flight on the graphed node while the trainer's next deltas
    reach the store one by one and are applied in place: no request fails, and every answer
    is the eager CPU model's scores of the version it names, the old one or a new one (each
    delta moves the scores by far more than the tolerance, so an answer mixing two versions'
    weights would match neither)."""
    base, store_root, versions = cuda_server
    root = published_model[0]
    added = versions[2:6]
    for old, new in zip(versions[1:], added):
        assert np.abs(expected[new] - expected[old]).max() > 20 * CUDA_VS_CPU_ATOL, (old, new)
    rows = instances.to_pylist()
    bodies = [{"instances": rows}, {"instances": rows[:8]}, {"instances": rows[8:11]}]
    offsets = [0, 0, 8]
    answers: list[tuple[int, dict]] = []
    failures: list[tuple[int, dict]] = []
    stop = threading.Event()

    def load(k: int) -> None:
        while not stop.is_set():
            status, answer = call(base, "POST", "/v1/models/ctr:predict", bodies[k % 3])
            if status == 200:
                answers.append((k % 3, answer))
            else:
                failures.append((status, answer))

    clients = [threading.Thread(target=load, args=(k,)) for k in range(6)]
    for c in clients:
        c.start()
    try:
        publish_in_turn(root, store_root, added, base)
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert not failures, failures[:3]
    seen = {a["model_version"] for _, a in answers}
    assert added[-1] in seen and len(seen) >= 3, seen
    apart = {v: 0.0 for v in seen}
    for k, answer in answers:
        want = expected[answer["model_version"]][offsets[k]:offsets[k] + len(bodies[k]["instances"])]
        apart[answer["model_version"]] = max(apart[answer["model_version"]], float(np.abs(np.asarray(answer["scores"]) - want).max()))
    print(f"{len(answers)} answers; by version, the largest difference from its eager CPU scores: {apart}")
    assert max(apart.values()) <= CUDA_VS_CPU_ATOL, apart
    status = call(base, "GET", "/v1/models/ctr")[1]
    assert [a["mode"] for a in status["applies"] if a["version"] in added] == ["delta"] * len(added), status["applies"]
    assert status["runtime"]["mode"] == "graph" and status["runtime"]["eager_batches"] == 0, status["runtime"]
