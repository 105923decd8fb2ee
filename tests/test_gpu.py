"""CUDA paths, run on a GPU machine with ``pytest -m gpu`` (skipped without CUDA): the hash
index's Triton kernels (probe, insert, removal) agree with the torch path; a version served
from CUDA graphs in shape buckets (serving's runner wrapping the model package's
InferenceModel) scores like the eager model, also after a delta applied in place; a pinned
batch; a snapshot's one-launch read of cached rows; the trainer's CUDA-graph dense step
trains like the eager model and its optimizer resumes fused; the mapped DRAM tier keeps
its budget.

Needs only torch, numpy, pyarrow, rocksdict and pytest (no broker, no trainer run): the version
is written straight into a model store."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from streamrec.model.batch import TABLES, batch_from_table
from streamrec.model.network import CTRModel, ModelSpec
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.embedding.hash_index import HashIndex
from streamrec.contracts.delta import SparseDelta
from streamrec.modelstore.store import ModelStore
from streamrec.modelstore.writer import VersionWriter
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.runtime.state import ServedModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPEC = FeatureSpec()
MODEL = ModelSpec(embedding_dim=16, history_len=50, n_dense=18, attention_hidden=64, cross_layers=2, mlp=(256, 128))


def test_hash_index_kernels_agree_with_the_torch_path():
    g = torch.Generator().manual_seed(0)
    keys = torch.unique(torch.randint(-(2**62), 2**62, (200_000,), generator=g))
    values = torch.arange(len(keys))
    gpu, cpu = HashIndex(1024, "cuda"), HashIndex(1024, "cpu")
    for part in range(4):  # grows (rehash) between inserts
        sl = slice(part * len(keys) // 4, (part + 1) * len(keys) // 4)
        gpu.insert(keys[sl], values[sl])
        cpu.insert(keys[sl], values[sl])
    probe = torch.cat([keys[::3], torch.randint(-(2**62), 2**62, (50_000,), generator=g)])
    assert torch.equal(gpu.lookup(probe).cpu(), cpu.lookup(probe))
    # the removal kernel tombstones what the torch path would, and later probes walk past them
    gone = torch.cat([keys[::5], torch.randint(-(2**62), 2**62, (10_000,), generator=g)]).unique()
    assert torch.equal(gpu.remove(gone).cpu(), cpu.remove(gone))
    assert torch.equal(gpu.lookup(probe).cpu(), cpu.lookup(probe))
    assert len(gpu) == len(cpu) == len(keys) - len(keys[::5])


def _instances(n: int, rng: np.random.Generator) -> pa.Table:
    lengths = rng.integers(0, 51, n)
    hist = [rng.integers(1, 500, k).tolist() for k in lengths]
    cols = {f.name: None for f in SPEC.fields(with_label=False)}
    cols.update(sample_version=[1] * n, event_id=[f"e{i}" for i in range(n)], request_id=[f"r{i}" for i in range(n)],
                ts=[1_700_000_000_000] * n, user_id=rng.integers(1, 2000, n).tolist(), item_id=rng.integers(1, 500, n).tolist(),
                position=rng.integers(1, 5, n).tolist(), device=["ios"] * n, local_hour=rng.integers(0, 24, n).tolist(),
                category_id=rng.integers(1, 40, n).tolist(), advertiser_id=rng.integers(1, 300, n).tolist(),
                hist_item_ids=hist, hist_category_ids=[[h % 40 + 1 for h in row] for row in hist],
                **{c: rng.integers(0, 50, n).tolist() for c in SPEC.counter_columns()})
    return pa.table(cols, schema=SPEC.schema(with_label=False))


def test_graph_buckets_score_like_the_eager_model_before_and_after_a_delta(tmp_path):
    torch.manual_seed(0)
    store = ModelStore(str(tmp_path), "ctr")
    meta = {"model_spec": MODEL.to_json(), "feature_spec": SPEC.to_json()}
    dims = {name: MODEL.embedding_dim for name in TABLES}
    tables = {name: SparseDelta(torch.arange(1, 2001), torch.randn(2000, MODEL.embedding_dim)) for name in TABLES}
    dense = CTRModel(MODEL).state_dict()
    writer = VersionWriter(store)
    full = writer.publish("full", tables, dims, dense, meta)
    delta_tables = {name: SparseDelta(torch.arange(1, 301), torch.randn(300, MODEL.embedding_dim), torch.arange(1901, 2001))
                    for name in TABLES}  # 300 rows updated, 100 erased
    delta = writer.publish("delta", delta_tables, dims, {k: v * 1.1 for k, v in dense.items()}, meta)

    runtime = RuntimeConfig("graph", (1, 4, 16, 64), (16, 50), max_extra=2, workers=2)
    graphs = ServedModel(store, "cuda", gpu_cache_rows=4096, runtime=runtime, feature_spec=SPEC)
    eager = ServedModel(store, "cuda", gpu_cache_rows=4096, runtime=None, feature_spec=SPEC)
    rng = np.random.default_rng(1)
    for version in (full, delta):
        assert graphs.load(version).version == eager.load(version).version == version
        for n in (1, 3, 16, 50, 100):  # 100: beyond every bucket, eager at once and a bucket built behind
            batch = batch_from_table(_instances(n, rng), SPEC, MODEL.history_len, with_labels=False)
            got, want = graphs.predict(batch)[1], eager.predict(batch)[1]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    stats = graphs.current.runner.stats.as_json()
    assert stats["mode"] == "graph" and stats["compiled_buckets"] >= 8 and stats["eager_batches"] >= 1
    # the delta applied in place on the GPU scores exactly like a node that loads it from the store
    fresh = ServedModel(store, "cuda", gpu_cache_rows=4096, runtime=None, feature_spec=SPEC)
    assert fresh.load(delta).mode == "swap"
    for n in (3, 64, 100):
        batch = batch_from_table(_instances(n, rng), SPEC, MODEL.history_len, with_labels=False)
        np.testing.assert_array_equal(eager.predict(batch)[1], fresh.predict(batch)[1])
        np.testing.assert_allclose(graphs.predict(batch)[1], fresh.predict(batch)[1], rtol=1e-5, atol=1e-6)
    graphs.close()
    eager.close()
    fresh.close()


def test_a_pinned_batch_holds_the_same_tensors_in_page_locked_memory():
    """SampleBatch.pin_memory lays every tensor into one pinned buffer: same values, dtypes
    and shapes, each pinned, and the host-to-device copy of each gives it back."""
    rng = np.random.default_rng(3)
    batch = batch_from_table(_instances(300, rng), SPEC, MODEL.history_len, with_labels=False)
    before = {name: getattr(batch, name).clone() for name in batch._tensors()}
    batch.pin_memory()
    for name, expected in before.items():
        got = getattr(batch, name)
        assert got.is_pinned() and got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), name
        assert torch.equal(got.to("cuda", non_blocking=True).cpu(), expected), name


def test_a_snapshot_reads_cached_rows_in_one_launch_and_the_rest_through_the_tiers(tmp_path):
    """Tiers.read_cached (``export(try_cache=True)``'s first try) answers only when the cache
    holds every key (the publish's common case); a delta whose keys partly live in DRAM is
    read through every tier and still holds every row's current value."""
    from streamrec.embedding.collection import EmbeddingCollection
    from streamrec.embedding.table import TableConfig

    store = EmbeddingCollection([TableConfig("t", 8, lr=0.1, gpu_cache_rows=1_000)], "cuda", work_dir=tmp_path)
    table = store["t"]
    g = torch.Generator().manual_seed(2)
    for step in range(6):  # 6 x 400 distinct keys through a 1,000-row cache: early rows are evicted to DRAM
        keys = torch.arange(step * 400, step * 400 + 400) + 1
        pulled = table.find_or_insert(keys.cuda(), now_ms=step)
        table.apply_gradients(pulled, torch.randn(len(pulled.keys), 8, generator=g).cuda())
    cached = torch.arange(2000, 2400) + 1
    values = table.tiers.read_cached(cached.cuda())
    assert values is not None
    _, expected, absent = table.export(cached, device="cuda")
    assert len(absent) == 0 and torch.equal(values, expected)
    assert table.tiers.read_cached((torch.arange(0, 2400) + 1).cuda()) is None  # rows 1..~1400 live in DRAM only
    snap = store.snapshot("delta")["t"]
    assert sorted(snap.keys.tolist()) == list(range(1, 2401)) and len(snap.deleted) == 0
    _, current, absent = table.export(snap.keys)
    assert len(absent) == 0 and torch.equal(snap.values, current)
    store.close()


def test_graphed_dense_steps_train_like_the_eager_model():
    """trainer/dense_graph.GraphedDense: full batches replay captured CUDA graphs, other
    shapes run eagerly; with Adam over several steps, the logits, the gradients reaching
    the embedding rows and the parameters equal those of the eager model."""
    import copy

    import torch.nn.functional as F

    from streamrec.trainer.dense_graph import GraphedDense

    torch.manual_seed(0)
    eager = CTRModel(MODEL).cuda()
    graphed_model = copy.deepcopy(eager)
    graphed = GraphedDense(graphed_model, 256, torch.device("cuda"))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, graphed_model)]
    g = torch.Generator(device="cuda").manual_seed(1)
    d, length = MODEL.embedding_dim, MODEL.history_len
    for step, b in enumerate([256, 256, 100, 256, 256, 37, 256]):  # partial batches run eagerly
        fields = torch.randn(b, 7, d, device="cuda", generator=g)
        history = torch.randn(b, length, 2 * d, device="cuda", generator=g)
        mask = torch.rand(b, length, device="cuda", generator=g) < 0.5
        dense = torch.randn(b, MODEL.n_dense, device="cuda", generator=g)
        label = (torch.rand(b, device="cuda", generator=g) < 0.3).float()
        results = []
        for forward, opt in ((eager, opts[0]), (graphed, opts[1])):
            f, h = fields.clone().requires_grad_(), history.clone().requires_grad_()
            logits = forward(f, h, mask, dense)
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(logits, label).backward()
            opt.step()
            results.append((logits.detach().clone(), f.grad, h.grad))
        for a, b_ in zip(*results):
            torch.testing.assert_close(b_, a, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    for p_eager, p_graphed in zip(eager.parameters(), graphed_model.parameters()):
        torch.testing.assert_close(p_graphed, p_eager, rtol=1e-5, atol=1e-6)



def test_the_mapped_dram_tier_keeps_its_budget_when_evictions_give_rows_a_home(tmp_path):
    """Rows created in the GPU cache get a DRAM home when evicted; when a batch's misses all
    come up from the mapped DRAM tier (the kernel path), DRAM must still spill to its budget:
    its size stays within the budget's headroom and its arrays are never regrown."""
    from streamrec.embedding.table import EmbeddingTable, TableConfig

    # batches of 1,500 rows fit the budget's headroom (an eighth of 16,000) before each spill
    table = EmbeddingTable(TableConfig("t", 8, dram_rows=16_000, gpu_cache_rows=3_000), "cuda", ssd_dir=tmp_path)
    dram = table.tiers.dram
    assert dram.mapped
    capacity, g = dram.capacity, torch.Generator().manual_seed(4)
    batches = [torch.arange(i * 1_500, (i + 1) * 1_500) + 1 for i in range(12)]
    for step, keys in enumerate(batches + batches[::-1] + batches):
        pulled = table.find_or_insert(keys.cuda(), now_ms=step)
        table.apply_gradients(pulled, torch.randn(len(pulled.keys), 8, generator=g).cuda())
        assert len(dram) <= 16_000 + 1_500 and dram.capacity == capacity, (step, len(dram))
    assert len(table) == 18_000 and table.stats["spilled"] > 0


def test_a_restored_dense_optimizer_is_fused_on_cuda_whatever_run_wrote_it():
    """A checkpoint's Adam state written by an unfused run (CPU, or an older trainer) comes
    back fused on CUDA, its step counters where the fused kernel wants them, and steps on."""
    from streamrec.trainer.session import fuse_adam_on

    param = torch.nn.Parameter(torch.ones(4, device="cuda"))
    unfused = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(4, device="cuda")
    unfused.step()
    restored = torch.optim.Adam([param], lr=0.1, fused=True)
    restored.load_state_dict(unfused.state_dict())
    fuse_adam_on(restored, torch.device("cuda"))
    assert restored.param_groups[0]["fused"] and restored.state[param]["step"].is_cuda
    restored.step()
    assert float(restored.state[param]["step"]) == 2.0


def test_the_trainers_pull_is_table_batched_and_trains_like_the_per_table_pull():
    """The collection's find_or_insert covers every table with one find-or-insert launch and
    apply_gradients with one optimizer launch (embedding/grouped.py) while every table
    inserts its rows on the device; a table whose cache has less free room than the batch
    has ids sends the step table by table. Both give the same model inputs, and the same
    rows after the update, on identical collections."""
    from streamrec.model.sparse import SparseFeatures
    from streamrec.embedding.collection import EmbeddingCollection
    from streamrec.embedding.table import TableConfig

    rng = np.random.default_rng(5)
    batch = batch_from_table(_instances(2000, rng), SPEC, MODEL.history_len, with_labels=False).to("cuda")
    roomy = [TableConfig(n, 16, lr=0.1, gpu_cache_rows=200_000) for n in TABLES]
    grouped_store, per_table_store = EmbeddingCollection(roomy, "cuda"), EmbeddingCollection(roomy, "cuda")
    per_table_store.table_batched = False  # the reference takes the per-table path
    grouped, per_table = SparseFeatures(grouped_store), SparseFeatures(per_table_store)
    for step in range(3):
        inputs, handles = grouped.training_inputs(batch, now_ms=step)
        assert handles.grouped is not None
        if step == 0:  # new rows are drawn on the device: give the per-table collection the same ones
            pulled = per_table_store.find_or_insert_each(SparseFeatures.table_ids(batch), now_ms=step)
            for name, p in handles.grouped.by_table.items():
                per_table_store[name].tiers.cache.weights[pulled[name].slots] = p.rows
        reference, ref_handles = per_table.training_inputs(batch, now_ms=step)
        assert ref_handles.grouped is None
        for got, want in zip(inputs.as_args(), reference.as_args()):  # (backward's atomic sums: not bit-equal)
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
        for model_inputs in (inputs, reference):
            (model_inputs.fields.square().sum() + model_inputs.history.sum()).backward()
        grouped.apply_gradients(handles)
        per_table.apply_gradients(ref_handles)
    for name in TABLES:
        keys = torch.unique(SparseFeatures.table_ids(batch)[name]).cpu()
        assert torch.allclose(grouped_store[name].export(keys)[1], per_table_store[name].export(keys)[1], atol=1e-5, rtol=1e-4)
    small = EmbeddingCollection([TableConfig(n, 16, gpu_cache_rows=200_000 if n != "item" else 4_000, dram_rows=0) for n in TABLES],
                           "cuda")
    assert SparseFeatures(small).training_inputs(batch, now_ms=1)[1].grouped is None
    for store in (grouped_store, per_table_store, small):
        store.close()


def test_model_inputs_are_assembled_without_a_host_sync():
    """SparseFeatures._assemble (every training step and serving batch) queues its work without
    waiting for the device: a sync there stalls the step's host thread, and on several ranks
    it also waits for the other ranks' rows (torch's sync debug mode raises on one)."""
    from streamrec.model.sparse import SparseFeatures

    rng = np.random.default_rng(3)
    batch = batch_from_table(_instances(500, rng), SPEC, MODEL.history_len, with_labels=False).to("cuda")
    emb = {name: torch.randn(len(ids), 16, device="cuda") for name, ids in SparseFeatures.table_ids(batch).items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inputs = SparseFeatures._assemble(batch, emb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert inputs.history.shape[0] == len(batch) and bool(inputs.history_mask.any())
