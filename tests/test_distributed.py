"""The sharded trainer on CPU (gloo ranks): the embedding exchange equals one store (and, on
two GPUs, the owner's table-batched path equals its table-by-table one), shards are
balanced, a step of 2 ranks has the dense gradients of 1 rank on the same samples, 2 ranks
learn as well as 1 on the same data, a version written by 2 ranks serves over real HTTP
with the ranks' own scores, and a rank killed with SIGKILL gives a clean failure, after
which a restart ends exactly where an uninterrupted run ends."""

import json
import os
import re
from dataclasses import asdict, replace
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO, free_port, make_sample_run, run_cli, train_cli
from streamrec.model.batch import batch_from_table
from streamrec.model.network import CTRModel, ModelSpec
from streamrec.model.sparse import SparseFeatures
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.embedding.sharded import ShardedCollection, layout_on_host, owner_of, plan_placement
from streamrec.embedding.collection import EmbeddingCollection
from streamrec.embedding.table import TableConfig
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.config import ConfigError, load_config
from streamrec.trainer.checkpoint import Checkpointer
from streamrec.trainer.distributed import Ranks, agree
from streamrec.trainer.driver import Trainer, TrainOptions
from streamrec.trainer.sources import FileSampleSource
from streamrec.trainer.step_channel import StepChannel

TABLES = [TableConfig("a", 4, optimizer="adagrad", lr=0.1, init_std=0.0), TableConfig("b", 4, optimizer="adam", lr=0.05, init_std=0.0)]


def _batches(rank: int, steps: int = 6, b_keys: int = 9) -> list[dict[str, torch.Tensor]]:
    """Per step, the ids each rank asks for: overlapping across ranks, duplicates within."""
    g = torch.Generator().manual_seed(100 + rank)
    return [{"a": torch.randint(0, 50, (40,), generator=g) * 7919, "b": torch.randint(0, b_keys, (13,), generator=g)}
            for _ in range(steps)]


def _grad(ids: torch.Tensor, step: int) -> torch.Tensor:
    """A gradient per input id that depends only on the id and the step; tiny, so that the
    optimizers' eps makes them sensitive to its scale (averaging over ranks is checked)."""
    g = torch.stack([(ids % 11).float() - 5, (ids % 3).float(), torch.full((len(ids),), step * 0.1, device=ids.device),
                     torch.ones(len(ids), device=ids.device)], 1)
    return g * 1e-8




def _run_two_ranks(worker, tmp_path: Path, args_of, timeout_s: float) -> None:
    """``worker(rank, 2, init, *args_of(rank))`` in two spawned processes joined by a file
    rendezvous under ``tmp_path``; both must exit 0."""
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [mp.get_context("spawn").Process(target=worker, args=(r, 2, init, *args_of(r))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
        assert p.exitcode == 0

def _join(rank: int, world: int, init: str, backend: str) -> tuple[torch.device, Ranks]:
    """This rank's device (one GPU per rank with NCCL: the GPU-cache tier and the Triton
    kernels; CPU with gloo) and its process groups."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    control = dist.new_group(backend="gloo")
    return device, Ranks(rank, world, dist.group.WORLD, control, steps=StepChannel.open(rank, world, control, timeout_s=60))


def _step(sharded: ShardedCollection, ranks: Ranks, ids: dict, step: int, agreed: bool, on_host: bool = False,
          average: torch.Tensor | None = None) -> tuple[Any, dict]:
    """One step of the exchange: split sizes agreed first (``agreed``; the ids laid out on
    the host with ``on_host``, as the trainer's prefetch thread does) or exchanged by
    find_or_insert; then backward with ``_grad`` as the model's would leave it, and the update.
    ``average``: a tensor the update's all_to_all averages over the ranks too.
    Returns the rows found and a copy of them taken before the update."""
    if agreed:
        host = layout_on_host({n: t.cpu() for n, t in ids.items()}, sharded.world, pin=ids["a"].is_cuda,
                              every_sighting=sharded.every_sighting) if on_host else None
        if on_host:  # the host's layout is the device's
            on_device = sharded._layout(ids)
            assert host.send_counts == on_device.send_counts and host.sizes == on_device.sizes
            assert torch.equal(host.routed.to(ids["a"].device), torch.cat([on_device.keys, on_device.inverse]))
        counts = sharded.plan(None if on_host else ids, host=host)
        agreed_step = agree(ranks, 1, ended=False, stop=False, now_ms=step, counts=counts, to_each=sharded.keys_out())
        assert (agreed_step.keys_from is not None) == on_host  # keys laid out on the host ride in the agreement
        sharded.agreed(agreed_step.counts, agreed_step.keys_from)
    pulled = sharded.find_or_insert(ids, now_ms=step)
    before = {n: pulled.embeddings[n].detach().cpu() for n in ids}
    torch.autograd.backward([pulled.embeddings[n] for n in ids], [_grad(ids[n], step) for n in ids])
    sharded.apply_gradients(pulled, average=average)
    return pulled, before


EXACT = {"rtol": 0.0, "atol": 0.0}


def _tolerance(backend: str) -> dict[str, float]:
    """``assert_close``'s tolerance for two ranks against one store. A key's gradients from
    both ranks are summed in another order (each requester sums its own first), so on CPU
    values agree to a few float32 roundings, relative to each value (measured up to 2e-7;
    weights and optimizer state alike, whose scales differ by orders of magnitude); the
    GPU's fused optimizer kernels also round differently from torch on CPU."""
    return {"rtol": 1e-6, "atol": 0.0} if backend == "gloo" else {"rtol": 0.0, "atol": 1e-5}


def _replay_on_one_store(ref: EmbeddingCollection, per_rank: list, tables: tuple[str, ...], checked: tuple[str, ...], got: list,
                         tol: dict[str, float]) -> None:
    """Both ranks' batches, step by step, on one store ``ref``: the rows each rank pulled of
    the ``checked`` tables must be the store's, and every table is updated with the two
    ranks' gradients averaged, as the ranks' exchange does."""
    for step in range(len(per_rank[0])):
        both = {n: torch.cat([per_rank[0][step][n], per_rank[1][step][n]]) for n in tables}
        pulled = ref.find_or_insert_each(both, now_ms=step)
        for r in range(2):
            for n in checked:
                lo = 0 if r == 0 else len(per_rank[0][step][n])
                want = pulled[n].embeddings()[lo:lo + len(per_rank[r][step][n])]
                torch.testing.assert_close(got[r]["pulled"][step][n], want, **tol)
        for n in tables:
            summed = torch.zeros_like(pulled[n].rows).index_add_(0, pulled[n].inverse, _grad(both[n], step))
            ref[n].apply_gradients(pulled[n], summed / 2)


def _exchange_worker(rank: int, world: int, init: str, out: str, backend: str = "gloo", how: str = "counts_exchanged",
                     tables: list[TableConfig] = TABLES, b_keys: int = 9) -> None:
    """``how``: the split sizes travel in the trainer's per-step agreement (``plan``,
    ``agree``, ``agreed``) from ids laid out on the device (``counts_agreed``) or on the host
    (``laid_out_on_host``), else in the exchange's own counts all_to_all (``counts_exchanged``)."""
    device, ranks = _join(rank, world, init, backend)
    store = EmbeddingCollection([replace(c, gpu_cache_rows=4096) for c in tables], device)
    sharded = ShardedCollection(store)
    pulled_rows, averaged = [], []
    for step, ids in enumerate(_batches(rank, b_keys=b_keys)):
        # with the keys in the agreement, the update also averages a buffer (the trainer's dense gradients)
        average = torch.full((5,), float(rank + 1) * (step + 1), device=device) if how == "laid_out_on_host" else None
        pulled_rows.append(_step(sharded, ranks, {n: t.to(device) for n, t in ids.items()}, step, how != "counts_exchanged",
                                 on_host=how == "laid_out_on_host", average=average)[1])
        averaged.append(average.tolist() if average is not None else None)
    rows = {n: {k: v.tolist() for keys, values in store[n].export_all() for k, v in zip(keys.tolist(), values)} for n in store.tables}
    torch.save({"pulled": pulled_rows, "rows": rows, "stats": asdict(sharded.stats), "averaged": averaged}, out)
    if how == "laid_out_on_host":
        _refused_alike(sharded, ranks, device)
    dist.destroy_process_group()


def _refused_alike(sharded: ShardedCollection, ranks: Ranks, device: torch.device) -> None:
    """What the exchange refuses, each rank on its own before any collective (so no rank is
    left waiting in one): an agreement whose keys disagree with its counts, and a buffer to
    average whose dtype is not the gradients'."""
    ids = {n: t.to(device) for n, t in _batches(ranks.rank, steps=1)[0].items()}

    def laid_out() -> list[int]:
        host = layout_on_host({n: t.cpu() for n, t in ids.items()}, sharded.world, pin=device.type == "cuda",
                              every_sighting=sharded.every_sighting)
        return sharded.plan(None, host=host)

    counts, mine = laid_out(), sharded.keys_out()[ranks.rank]
    with pytest.raises(RuntimeError, match="the agreement brought"):  # a rank's keys one short of its counts
        sharded.agreed([counts, counts], [mine, mine[:-1]])
    counts = laid_out()
    agreed = agree(ranks, 1, ended=False, stop=False, now_ms=99, counts=counts, to_each=sharded.keys_out())
    sharded.agreed(agreed.counts, agreed.keys_from)
    pulled = sharded.find_or_insert(ids, now_ms=99)
    torch.autograd.backward([pulled.embeddings[n] for n in ids], [_grad(ids[n], 99) for n in ids])
    with pytest.raises(ValueError, match="cannot average a torch.float64 tensor"):
        sharded.apply_gradients(pulled, average=torch.zeros(5, dtype=torch.float64, device=device))


BACKENDS = ["gloo"] + ([pytest.param("nccl", marks=pytest.mark.gpu)] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("how", ["counts_agreed", "laid_out_on_host", "counts_exchanged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_exchange_over_two_ranks_equals_one_store_on_both_batches(tmp_path, backend, how):
    """Rows read by each rank and rows stored by each owner equal one store that sees both
    ranks' ids and the average of their gradients (DDP's averaging) at each step; with the
    split sizes from the step's agreement (the trainer's way, the ids laid out on the device
    or on the host) or from the exchange's own counts all_to_all."""
    agreed = how != "counts_exchanged"
    _run_two_ranks(_exchange_worker, tmp_path, lambda r: (str(tmp_path / f"out{r}"), backend, how), timeout_s=120)
    got = [torch.load(tmp_path / f"out{r}") for r in range(2)]
    tol = _tolerance(backend)

    ref = EmbeddingCollection(TABLES)
    per_rank = [_batches(0), _batches(1)]
    _replay_on_one_store(ref, per_rank, ("a", "b"), ("a", "b"), got, tol)
    for n in ("a", "b"):
        keys, values = (torch.cat(parts) for parts in zip(*ref[n].export_all()))
        assert len(got[0]["rows"][n]) + len(got[1]["rows"][n]) == len(keys)
        for k, v, owner in zip(keys.tolist(), values, owner_of(keys, 2).tolist()):
            assert k in got[owner]["rows"][n] and k not in got[1 - owner]["rows"][n]  # one owner per key
            torch.testing.assert_close(torch.tensor(got[owner]["rows"][n][k]), v, **tol)

    # the exchange's counts: every id asked for, each distinct one sent once to its owner, and
    # the bytes that crossed to the other rank
    asked = [sum(len(ids) for batch in per_rank[r] for ids in batch.values()) for r in range(2)]
    keys = [[torch.unique(ids) for batch in per_rank[r] for ids in batch.values()] for r in range(2)]
    sent = [sum(len(k) for k in keys[r]) for r in range(2)]
    off_rank = [sum(int((owner_of(k, 2) != r).sum()) for k in keys[r]) for r in range(2)]
    stats = [g["stats"] for g in got]
    assert [s["steps"] for s in stats] == [6, 6] and [s["ids_asked"] for s in stats] == asked
    assert [s["ids_sent"] for s in stats] == sent and sent[0] < asked[0] and sent[1] < asked[1]
    assert [s["counts_exchanged"] for s in stats] == [0 if agreed else 6] * 2
    assert [s["keys_agreed"] for s in stats] == [6 if how == "laid_out_on_host" else 0] * 2  # no ids all_to_all then
    if how == "laid_out_on_host":  # the buffer averaged in the gradients' all_to_all: (1 + 2) / 2 times the step's number
        assert [g["averaged"] for g in got] == [[[1.5 * (step + 1)] * 5 for step in range(6)]] * 2
    assert sum(s["ids_received"] for s in stats) == sum(sent) and all(s["ids_received"] > 0 for s in stats)
    for r in range(2):
        row_bytes = 4 * 4  # dim 4, float32
        # int64 ids, and unless the agreement carried them, each step a count per (owner, table) for the other rank
        assert stats[r]["ids_bytes_out"] == 8 * (off_rank[r] + (0 if agreed else 2 * 2 * 6))  # else each rank's 2 x 2 counts per step
        assert stats[r]["grads_bytes_out"] == row_bytes * off_rank[r]
        assert stats[1 - r]["rows_bytes_out"] == row_bytes * off_rank[r]  # the other owner answered each of them


@pytest.mark.parametrize("how", ["counts_agreed", "laid_out_on_host"])
def test_a_table_whose_admission_counts_sightings_sends_every_id_and_admits_as_one_store(tmp_path, how):
    """A table with an admission sketch sends every id to its owner, not each key once, so
    that its owner counts every sighting: keys seen twice in one rank's batch are admitted
    as one store that sees both batches admits them."""
    tables, b_keys = [TABLES[0], replace(TABLES[1], admit_after=2)], 60  # b: most keys seen once or twice
    _run_two_ranks(_exchange_worker, tmp_path, lambda r: (str(tmp_path / f"out{r}"), "gloo", how, tables, b_keys), timeout_s=120)
    got = [torch.load(tmp_path / f"out{r}") for r in range(2)]
    ref = EmbeddingCollection(tables)
    per_rank = [_batches(0, b_keys=b_keys), _batches(1, b_keys=b_keys)]
    # every sighting sent: each owner sums a key's gradients in the one store's order, so exactly
    _replay_on_one_store(ref, per_rank, ("a", "b"), ("a", "b"), got, EXACT)
    keys = torch.cat([k for k, _ in ref["b"].export_all()])
    assert 0 < len(keys) < len(torch.unique(torch.cat([batch["b"] for r in range(2) for batch in per_rank[r]])))  # some not admitted
    assert sorted(keys.tolist()) == sorted([*got[0]["rows"]["b"], *got[1]["rows"]["b"]])  # the same keys admitted
    for r in range(2):
        want = sum(len(torch.unique(batch["a"])) + len(batch["b"]) for batch in per_rank[r])
        assert got[r]["stats"]["ids_sent"] == want


REPLICATED_C = TableConfig("c", 4, optimizer="adagrad", lr=0.1, init_std=0.01, admit_after=2)  # random rows, admission


def _replicated_tables(backend: str) -> list[TableConfig]:
    """"a", "b" and "c"; on GPUs all three of one kind (zeros, Adagrad, no admission), so that
    the step's find_or_insert and update are table-batched over sharded and replicated tables (grouped.py)."""
    if backend == "gloo":
        return [*TABLES, REPLICATED_C]
    return [replace(TABLES[0], name=n) for n in ("a", "b", "c")]


def _replicated_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """``_batches`` and a third table, few keys seen often (some too rarely to be admitted at first)."""
    return [{**ids, "c": ids["a"][::2] % 23 + 10 * (ids["b"][:3].sum() % 4)} for ids in _batches(rank)]


def _replicated_worker(rank: int, world: int, init: str, out: str, backend: str, agreed: bool) -> None:
    """Table "a" sharded, "b" (no random init) and "c" (random init, admission) replicated,
    each rank seeding its tables differently; per step, find_or_insert, a backward with
    ``_grad`` and apply_gradients. Saves what each rank pulled and every row it holds."""
    device, ranks = _join(rank, world, init, backend)
    store = EmbeddingCollection([replace(c, gpu_cache_rows=4096) for c in _replicated_tables(backend)], device, seed=1000 * rank)
    sharded = ShardedCollection(store, replicated=["b", "c"])
    pulled_rows, grouped = [], []
    for step, ids in enumerate(_replicated_batches(rank)):
        pulled, rows = _step(sharded, ranks, {n: t.to(device) for n, t in ids.items()}, step, agreed)
        pulled_rows.append(rows)
        grouped.append(pulled.grouped is not None)
    torch.save({"pulled": pulled_rows, "rows": _rows_of(store), "stats": asdict(sharded.stats), "grouped": grouped}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("agreed", [True, False], ids=["counts_agreed", "counts_exchanged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_replicated_tables_train_as_one_store_and_stay_equal_on_every_rank(tmp_path, backend, agreed):
    """Two ranks, "a" sharded, "b" and "c" replicated (every rank holds them whole and trains
    them data-parallel): the rows each rank pulls and every row of "a" and "b" equal one
    store that sees both ranks' ids and the average of their gradients, as an all-sharded
    exchange does; "c", whose new rows are random and admitted after two sightings, holds
    on both ranks the same rows, bit for bit (weights, optimizer state, clock), and the
    keys one store admits. On GPUs the three tables are of one kind (zeros, no admission),
    so that the owner's step takes the table-batched path, replicated tables included."""
    _run_two_ranks(_replicated_worker, tmp_path, lambda r: (str(tmp_path / f"out{r}"), backend, agreed), timeout_s=120)
    got = [torch.load(tmp_path / f"out{r}", weights_only=False) for r in range(2)]
    tol = _tolerance(backend)

    ref = EmbeddingCollection(_replicated_tables(backend))
    assert all(all(g["grouped"]) == (backend == "nccl") for g in got)
    per_rank = [_replicated_batches(0), _replicated_batches(1)]
    _replay_on_one_store(ref, per_rank, ("a", "b", "c"), ("a", "b"), got, tol)
    want = _rows_of(ref)
    rows = [g["rows"] for g in got]
    assert len(rows[0]["a"]) + len(rows[1]["a"]) == len(want["a"]) and min(len(rows[0]["a"]), len(rows[1]["a"])) > 0  # sharded
    for n in ("b", "c"):  # replicated: every key on both ranks, bit for bit the same row
        assert rows[0][n].keys() == rows[1][n].keys() == want[n].keys() and len(want[n]) > 0, n
        for k, (w, s_, seen) in rows[0][n].items():
            w1, s1, seen1 = rows[1][n][k]
            assert torch.equal(w, w1) and torch.equal(s_, s1) and seen == seen1, (n, k)
    compared = ("a", "b", "c") if backend == "nccl" else ("a", "b")
    if backend == "gloo":
        assert any(bool(w.abs().sum() > 0) for w, _, _ in rows[0]["c"].values())  # "c"'s rows began random, and equal
    for r in range(2):
        for n in compared:
            for k, (w, s_, seen) in rows[r][n].items():
                torch.testing.assert_close(w, want[n][k][0], **tol)
                torch.testing.assert_close(s_, want[n][k][1], **tol)
                assert seen == want[n][k][2]
    asked_a = [sum(len(batch["a"]) for batch in per_rank[r]) for r in range(2)]
    stats = [g["stats"] for g in got]
    assert [s_["ids_asked"] for s_ in stats] == asked_a  # only the sharded table's ids go to owners
    assert [s_["ids_sent"] for s_ in stats] == [sum(len(torch.unique(batch["a"])) for batch in per_rank[r]) for r in range(2)]
    assert stats[0]["replicated_rows"] == stats[1]["replicated_rows"] > 0
    assert all(s_["replicated_bytes_out"] > 0 for s_ in stats)
    assert [s_["counts_exchanged"] for s_ in stats] == [0 if agreed else 6] * 2


def test_the_planner_replicates_small_tables_that_fit_and_obeys_overrides():
    configs = [TableConfig(n, 8, gpu_cache_rows=rows) for n, rows in (("user", 1000), ("category", 1000), ("context", 1000), ("ad", 10))]
    rows = {"user": 10_000_000, "category": 500, "ad": 500}  # "context": no estimate
    assert plan_placement(configs, 2, rows, 1000, {}, on_gpu=False) == \
        {"user": "sharded", "category": "replicated", "context": "sharded", "ad": "replicated"}
    # on GPUs a replicated table must fit its GPU cache on every rank ("ad": 500 rows, 10 cached)
    assert plan_placement(configs, 2, rows, 1000, {}, on_gpu=True)["ad"] == "sharded"
    assert plan_placement(configs, 2, rows, 1000, {"category": "sharded", "context": "replicated"}, on_gpu=False) == \
        {"user": "sharded", "category": "sharded", "context": "replicated", "ad": "replicated"}
    assert set(plan_placement(configs, 1, rows, 1000, {"ad": "replicated"}, on_gpu=False).values()) == {"sharded"}  # one rank
    assert set(plan_placement(configs, 4, rows, 0, {}, on_gpu=False).values()) == {"sharded"}  # the default: no threshold
    for bad_rows, overrides, message in [({"items": 3}, {}, "no table named items"), ({}, {"ad": "mirrored"}, "neither"),
                                         ({}, dict.fromkeys(("user", "category", "context", "ad"), "replicated"), "one at least")]:
        with pytest.raises(ValueError, match=message):
            plan_placement(configs, 2, bad_rows, 1000, overrides, on_gpu=False)
    # pipelining and replication are exclusive, refused when the config loads
    with pytest.raises(ConfigError, match="pipeline_exchange cannot run with replicated tables"):
        load_config(overrides={"trainer.pipeline_exchange": True, "trainer.placement": "category=replicated"}, environ={})
    with pytest.raises(ConfigError, match="table=value pairs"):
        load_config(overrides={"trainer.table_rows": "category"}, environ={})


def _rows_of(store: EmbeddingCollection) -> dict[str, dict[int, tuple]]:
    """Every row of every table: key -> (weights, optimizer state, clock), on the host."""
    return {n: {k: (w, s, seen) for keys, weights, state, last_seen in t.export_all(with_state=True)
                for k, w, s, seen in zip(keys.tolist(), weights, state, last_seen.tolist())} for n, t in store.tables.items()}


def _pipelined_worker(rank: int, world: int, init: str, out: str, root: str, backend: str = "gloo") -> None:
    """Per table set, two identical shards over the same ranks and steps: one steps in turn
    (find_or_insert, backward, apply_gradients), one pipelined (the next step's prefetch
    between find_or_insert and apply_gradients, as the trainer does). Saves, per step, the
    rows each pulled and every row each owns after its update and the next find_or_insert,
    and the exchange counters."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    gpu = backend == "nccl"
    cache = 4096 if gpu else 0
    # on the GPU the owner's find_or_insert runs ahead where every row stays in the cache (one
    # optimizer: the table-batched path); on CPU where rows live in DRAM without a budget, admission included
    ahead_b = TableConfig("b", 4, optimizer="adagrad", lr=0.1, gpu_cache_rows=cache) if gpu else \
        TableConfig("b", 4, optimizer="adam", lr=0.05, admit_after=2)
    sets = {  # the owner's find_or_insert runs ahead / it waits its turn (rows may move: a DRAM budget, an admission sketch)
        "ahead": [TableConfig("a", 4, optimizer="adagrad", lr=0.1, gpu_cache_rows=cache), ahead_b],
        "budget": [TableConfig("a", 4, optimizer="adagrad", lr=0.1, gpu_cache_rows=cache),
                   TableConfig("b", 4, optimizer="adam", lr=0.05, admit_after=2, gpu_cache_rows=cache),
                   TableConfig("c", 4, optimizer="adagrad", lr=0.1, gpu_cache_rows=20 if gpu else 0, dram_rows=0 if gpu else 12)],
    }
    g = torch.Generator().manual_seed(200 + rank)
    steps = [{"a": torch.randint(0, 40, (30,), generator=g) * 7919, "b": torch.randint(0, 12, (9,), generator=g),
              "c": torch.randint(0, 60, (12,), generator=g)} for _ in range(8)]  # steps share most keys
    result = {}
    for name, configs in sets.items():
        stores = {mode: EmbeddingCollection(configs, device, Path(root) / f"{name}-{mode}-{rank}", seed=1000 * rank)
                  for mode in ("in_turn", "pipelined")}
        sharded = {mode: ShardedCollection(store) for mode, store in stores.items()}
        batches = [{n: t.to(device) for n, t in ids.items() if n in stores["in_turn"].tables} for ids in steps]
        seen, current, grouped = {mode: [] for mode in stores}, {mode: [] for mode in stores}, []
        for mode, collection in sharded.items():
            pulled = collection.find_or_insert(batches[0], now_ms=1000)
            for step, ids in enumerate(batches):
                if mode == "pipelined" and step + 1 < len(batches):
                    with collection.ahead_stream():
                        collection.prefetch(batches[step + 1], now_ms=1000 * (step + 2))
                    # where nothing moved, this step's rows keep their slots: its update needs no lookup by key
                    current[mode].append(all(stores[mode][n].current(pulled.owned[n]) for n in ids))
                grads = [torch.stack([(t % 11) - 5, t % 3, torch.full_like(t, step), torch.ones_like(t)], 1).float() * 0.01
                         for t in ids.values()]
                torch.autograd.backward([pulled.embeddings[n] for n in ids], grads)
                collection.apply_gradients(pulled)
                rows = {n: pulled.embeddings[n].detach().cpu() for n in ids}
                grouped.append(pulled.grouped is not None)
                if step + 1 < len(batches):  # the rows are compared once both orders have made the next step's
                    pulled = collection.find_or_insert(batches[step + 1], now_ms=1000 * (step + 2))
                seen[mode].append((rows, _rows_of(stores[mode])))
        result[name] = {"seen": seen, "current": current["pipelined"], "grouped": grouped,
                        "stats": {mode: asdict(c.stats) for mode, c in sharded.items()}}
        for store in stores.values():
            store.close()
    torch.save(result, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pipelined_exchange_trains_exactly_as_steps_in_turn(tmp_path, backend):
    """Two ranks, the next step's ids exchanged (and its rows created by their owners) before
    this step's update: at every step, the rows each rank pulled, and every row each owner
    holds once the next step's rows exist (weights, optimizer state, clock), equal those of
    steps taken in turn, with the
    owner's find_or_insert ahead where no row can move, and in its turn under a DRAM budget."""
    _run_two_ranks(_pipelined_worker, tmp_path, lambda r: (str(tmp_path / f"out{r}"), str(tmp_path), backend), timeout_s=300)
    tol = 0.0 if backend == "gloo" else 1e-6
    for r in range(2):
        got = torch.load(tmp_path / f"out{r}", weights_only=False)
        for name, run in got.items():
            stats = run["stats"]
            assert stats["pipelined"]["ahead"] == 7 and stats["in_turn"]["ahead"] == 0, (name, stats)
            assert stats["pipelined"]["found_ahead"] == (7 if name == "ahead" else 0), (name, stats)
            assert run["current"] == [True] * 7, (name, run["current"])
            assert all(run["grouped"]) == (backend == "nccl" and name == "ahead"), (name, run["grouped"])  # the owner's path
            for step, ((pulled, rows), (pulled_in_turn, rows_in_turn)) in enumerate(zip(run["seen"]["pipelined"], run["seen"]["in_turn"])):
                for n, want in pulled_in_turn.items():
                    torch.testing.assert_close(pulled[n], want, rtol=0, atol=tol, msg=lambda m: f"{name} rank {r} step {step} {n}: {m}")
                for n, table in rows_in_turn.items():
                    assert rows[n].keys() == table.keys() and len(table) > 0, (name, r, step, n)
                    for k, (w, s, seen) in table.items():
                        torch.testing.assert_close(rows[n][k][0], w, rtol=0, atol=tol)
                        torch.testing.assert_close(rows[n][k][1], s, rtol=0, atol=tol)
                        assert rows[n][k][2] == seen, (name, r, step, n, k)


def _grouped_owner_worker(rank: int, world: int, init: str, out: str) -> None:
    """Per optimizer, three identical shards over the same ranks and steps: one whose owner side
    is table-batched (its tables are groupable), one forced table by table, and one
    table-batched that agrees on its keys first, as the trainer does (laid out on the host,
    sent in the agreement: no ids collective). Saves what
    each rank pulled, every row it owns (weights, optimizer state, clock), the tables'
    counters, and the host syncs of each step (the agreement's own excepted)."""
    import warnings

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dist.barrier()  # the communicator's start is no step's host sync
    result = {}
    for optimizer in ("adagrad", "adam"):
        configs = [TableConfig(n, 4, optimizer=optimizer, lr=0.1, init_std=0.0, gpu_cache_rows=4096) for n in ("a", "b", "c")]
        stores = {"grouped": EmbeddingCollection(configs, device), "per_table": EmbeddingCollection(configs, device),
                  "agreed": EmbeddingCollection(configs, device)}
        stores["per_table"].table_batched = False
        sharded = {path: ShardedCollection(store) for path, store in stores.items()}
        pulled_rows, syncs = {path: [] for path in stores}, {path: [] for path in stores}
        for step, ids in enumerate(_batches(rank, steps=8)):
            ids = {"a": ids["a"], "b": ids["b"], "c": ids["a"][::3] % 17}  # "c": repeats, few keys
            ids = {n: t.to(device) for n, t in ids.items()}
            for path, collection in sharded.items():
                if path == "agreed":  # the step's agreement: counts and keys through the host, before the step
                    counts = collection.plan(None, host=layout_on_host({n: t.cpu() for n, t in ids.items()}, world, pin=True))
                    every: list = [None] * world
                    dist.all_gather_object(every, (counts, collection.keys_out()))
                    collection.agreed([c for c, _ in every], [keys[rank] for _, keys in every])
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    pulled = collection.find_or_insert(ids, now_ms=step)
                    # gradients with exact sums (multiples of 2**-12), so the paths' summation orders agree
                    grads = [torch.stack([(t % 11) - 5, t % 3, torch.full_like(t, step), torch.ones_like(t)], 1).float() * 2.0 ** -12
                             for t in ids.values()]
                    torch.autograd.backward([pulled.embeddings[n] for n in ids], grads)
                    collection.apply_gradients(pulled)
                torch.cuda.set_sync_debug_mode("default")
                assert (pulled.grouped is not None) == (path != "per_table"), (path, step)
                syncs[path].append(sum("synchronizing" in str(w.message) for w in caught))
                pulled_rows[path].append({n: pulled.embeddings[n].detach().cpu() for n in ids})
        torch.cuda.synchronize()
        assert sharded["agreed"].stats.keys_agreed == 8 and sharded["grouped"].stats.keys_agreed == 0
        result[optimizer] = {path: {"pulled": pulled_rows[path], "syncs": syncs[path],
                                    "stats": {n: dict(t.stats) for n, t in store.tables.items()},
                                    "rows": {n: {k: (w, s, seen) for keys, weights, state, last_seen in t.export_all(with_state=True)
                                                 for k, w, s, seen in zip(keys.tolist(), weights, state, last_seen.tolist())}
                                             for n, t in store.tables.items()}}
                             for path, store in stores.items()}
        for store in stores.values():
            store.close()
    torch.save(result, out)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_the_table_batched_owner_path_equals_the_per_table_path_over_two_gpus(tmp_path):
    """Two NCCL ranks: the owner's table-batched find_or_insert and apply_gradients (one
    launch each for all tables) give what the table-by-table path gives: the rows each rank
    pulled, every owned row's weights, optimizer state and clock, the tables' counters,
    with no more host syncs per step (Adagrad and Adam, each over three groupable tables);
    and so does the table-batched path whose keys came in the agreement, with fewer host
    syncs a step (its counts came with them)."""
    _run_two_ranks(_grouped_owner_worker, tmp_path, lambda r: (str(tmp_path / f"out{r}"),), timeout_s=300)
    for r in range(2):
        got = torch.load(tmp_path / f"out{r}", weights_only=False)
        for optimizer, paths in got.items():
            agreed = paths["agreed"]
            print(f"rank {r} {optimizer}: host syncs per step, keys agreed {agreed['syncs']}, on the device {paths['grouped']['syncs']}")
            assert all(a < g for a, g in zip(agreed["syncs"], paths["grouped"]["syncs"])), (optimizer, agreed["syncs"])
            _assert_same_training(optimizer, r, agreed, paths["per_table"])
            _assert_same_training(optimizer, r, paths["grouped"], paths["per_table"])


def _assert_same_training(optimizer: str, r: int, grouped: dict, per_table: dict) -> None:
    """What one path of ``_grouped_owner_worker`` pulled and left in its rows equals the per-table path's."""
    for step, (g, p) in enumerate(zip(grouped["pulled"], per_table["pulled"])):
        for n in p:
            torch.testing.assert_close(g[n], p[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{optimizer} rank {r} step {step} {n}: {m}")
    assert grouped["stats"] == per_table["stats"], optimizer
    for n, rows in per_table["rows"].items():
        assert grouped["rows"][n].keys() == rows.keys() and len(rows) > 0, (optimizer, n)
        for k, (w, s, seen) in rows.items():
            gw, gs, gseen = grouped["rows"][n][k]
            torch.testing.assert_close(gw, w, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(gs, s, rtol=1e-6, atol=1e-7)
            assert gseen == seen
    assert all(g <= p for g, p in zip(grouped["syncs"], per_table["syncs"])), (optimizer, grouped["syncs"], per_table["syncs"])


def _write_samples(run: Path, rows: int, spec: FeatureSpec) -> None:
    """``rows`` checked samples of ``spec`` (random ids, histories, counters and labels) as
    ``run/samples.parquet``, the layout ``streamrec train --samples`` reads."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 6, rows)
    hist = [list(rng.integers(1, 80, n)) for n in lengths]
    label = rng.integers(0, 2, rows)
    ts = 1_700_000_000_000 + 10 * np.arange(rows)
    columns = {"sample_version": np.ones(rows, np.int16), "event_id": [f"e{i}" for i in range(rows)],
               "request_id": [f"r{i}" for i in range(rows)], "ts": ts, "user_id": rng.integers(1, 40, rows),
               "item_id": rng.integers(1, 80, rows), "position": rng.integers(0, 5, rows),
               "device": rng.choice(["ios", "android", "web"], rows).tolist(), "local_hour": rng.integers(0, 24, rows),
               "category_id": rng.integers(1, 12, rows), "advertiser_id": rng.integers(1, 20, rows),
               "hist_item_ids": hist, "hist_category_ids": [[i % 12 + 1 for i in h] for h in hist],
               **{name: rng.integers(0, 30, rows) for name in spec.counter_columns()},
               "label": label, "click_ts": [int(t) + 500 if y else None for t, y in zip(ts, label)]}
    run.mkdir(parents=True)
    pq.write_table(pa.table(columns, schema=spec.schema()), run / "samples.parquet")


def _dense_gradients(run: Path, root: Path, rank: int, world: int, port: int) -> dict[str, torch.Tensor]:
    """One step of the real trainer (session, loop, and DDP on several ranks) on this rank's
    share of ``run`` (its stripes, as the file source reads them; all of it on one rank);
    returns the dense parameters' gradients after the step (all-reduced on several ranks).
    Every rank holds a row for every id of the samples, its value a function of the key, so
    the embeddings do not depend on which rank created a row or when."""
    if world > 1:
        os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cfg = load_config(overrides={"trainer.model_store": str(root / "models"), "trainer.work_dir": str(root / "work"),
                                 "trainer.device": "cpu", "trainer.collective_timeout_s": 60.0}, environ={})
    trainer = Trainer(cfg, TrainOptions(files=[str(run)], progress=False, announce=False))
    try:
        session = trainer.session
        spec, history_len = session.feature_spec, session.spec.history_len
        every = batch_from_table(pq.read_table(run / "samples.parquet"), spec, history_len)
        ids = torch.unique(torch.cat([every.user, every.item, every.category, every.advertiser, every.context.flatten(),
                                      every.hist_items, every.hist_categories]))
        for table in session.embeddings.tables.values():
            table.load_rows(ids, torch.sin((ids % 1009).unsqueeze(1).float() * 0.37 + torch.arange(table.config.dim)) * 0.3)
        share = pa.concat_tables([c.table for c in FileSampleSource([str(run)], spec, shard=(rank, world)).chunks()])
        batch = batch_from_table(share, spec, history_len)
        exchange = trainer.loop.exchange  # on several ranks the split sizes travel in the agreement, as in the loop
        counts = exchange.plan(SparseFeatures.table_ids(batch)) if exchange is not None else []
        agreed = agree(session.ranks, len(batch), ended=False, stop=False, now_ms=int(every.ts.max()), counts=counts)
        if exchange is not None:
            exchange.agreed(agreed.counts)
        trainer.loop._step(batch, agreed)
        reduced = trainer.loop.dense_gradients
        if reduced is not None:  # backward accumulated into the buffer the ranks reduced: no copies
            assert all(p.grad.untyped_storage().data_ptr() == reduced.flat.untyped_storage().data_ptr() for p in reduced.params)
        return {name: p.grad.clone() for name, p in session.model.named_parameters() if p.grad is not None}
    finally:
        trainer.close()


def _dense_gradients_worker(run: Path, root: Path, rank: int, world: int, port: int, out: Path) -> None:
    torch.save(_dense_gradients(run, root, rank, world, port), out)


@pytest.mark.parametrize("rows", [192, 64])
def test_two_ranks_step_with_the_dense_gradients_of_one_rank_on_the_same_samples(tmp_path, rows):
    """The loss scaling of several ranks: a step of 2 ranks, each on its stripes of the same
    samples (128 and 64 rows; or 64 and none, a rank that steps with an empty batch),
    all-reduces to the dense gradients of one rank on all of them (the mean over the step's
    samples). Unequal shares tell a global mean from a mean of the ranks' means."""
    spec = FeatureSpec()
    run = tmp_path / "run"
    _write_samples(run, rows, spec)
    port = free_port()
    procs = [mp.get_context("spawn").Process(target=_dense_gradients_worker,
                                             args=(run, tmp_path / "two", r, 2, port, tmp_path / f"grads{r}"))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        one = _dense_gradients(run, tmp_path / "one", 0, 1, 0)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(one) > 10 and all(bool(g.abs().sum() > 0) for g in one.values())  # every parameter has a gradient
    for r in range(2):
        two = torch.load(tmp_path / f"grads{r}")
        assert two.keys() == one.keys()
        for name, grad in one.items():
            # the same mean, its sums in another order: within 2e-6 of the gradient's largest element
            # (measured under 1e-6), but for the attention score's last bias, which shifts every logit
            # of a softmax alike: its gradient is 0 but for rounding (under 1e-9 here)
            atol = 1e-9 if name == "attention.score.2.bias" else 2e-6 * float(grad.abs().max())
            torch.testing.assert_close(two[name], grad, rtol=0, atol=atol, msg=lambda m: f"rank {r}, {name}: {m}")


@pytest.mark.parametrize("world, tables", [(1, 3), (3, 5), (64, 5)])  # 64 x 5 codes: past one byte
def test_the_host_layout_sends_each_owner_each_key_once_table_by_table(world, tables):
    """Each owner gets, table by table, the distinct ids it owns, sorted (every id, sorted, of a
    table whose admission counts every sighting); each input id finds its own key again."""
    gen = torch.Generator().manual_seed(world)
    ids = {f"t{t}": torch.randint(-50, 50, (int(torch.randint(0, 500, (1,), generator=gen)),), generator=gen) * (2**40 + t)
           for t in range(tables)}
    every_sighting = {"t1"}
    plan = layout_on_host(ids, world, every_sighting=every_sighting)
    expected, counts = [], []
    for owner in range(world):  # by owner, then table; within a table by key
        for name, keys in ids.items():
            mine = keys[owner_of(keys, world) == owner]
            mine = torch.sort(mine).values if name in every_sighting else torch.unique(mine)
            expected.append(mine)
            counts.append(len(mine))
    sent = torch.cat(expected)
    n_keys = len(sent)
    assert torch.equal(plan.routed[:n_keys], sent)
    places = plan.routed[n_keys:]
    assert torch.equal(sent[places], torch.cat(list(ids.values())))
    counted = places[len(ids["t0"]):len(ids["t0"]) + len(ids["t1"])]
    assert len(torch.unique(counted)) == len(counted)  # every sighting of t1 is sent
    assert plan.send_counts == counts and plan.sizes == [len(k) for k in ids.values()]
    assert n_keys < sum(plan.sizes)  # the ids repeat: fewer keys than ids cross


@pytest.mark.parametrize("world", [2, 4, 8])
def test_shards_are_balanced_within_ten_percent_on_zipf_ids(world):
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.zipf(1.05, 2_000_000) % 5_000_000 * 2654435761 + 17)
    keys = torch.unique(ids)
    rows = torch.bincount(owner_of(keys, world), minlength=world).float()
    assert float(rows.max() / rows.mean()) < 1.1 and float(rows.min() / rows.mean()) > 0.9, rows.tolist()


@pytest.mark.parametrize("group_rows", [None, 1000], ids=["one_row_group", "many_row_groups"])
def test_file_shares_are_disjoint_cover_every_row_and_resume_exactly(sample_run, tmp_path, group_rows):
    """Each rank reads its share (stripes of a file of one row group; whole row groups of a
    file of many, as ``pipeline offline`` writes them); stopping anywhere and resuming from
    the position reads the rest of its share, so over all ranks every row is read exactly once."""
    from streamrec.trainer.sources import FileSampleSource

    table = pq.read_table(sample_run / "samples.parquet")
    path = tmp_path / "samples.parquet"
    pq.write_table(table, path, row_group_size=group_rows or table.num_rows)
    assert pq.ParquetFile(path).metadata.num_row_groups == (1 if group_rows is None else -(-table.num_rows // group_rows))
    seen = []
    for rank in range(3):
        first = FileSampleSource([str(path)], FeatureSpec(), chunk_rows=5000, shard=(rank, 3))
        chunks = first.chunks()
        head = [next(chunks) for _ in range(4)]
        position = head[-1].consumed
        rest = list(FileSampleSource([str(path)], FeatureSpec(), start=position, chunk_rows=5000, shard=(rank, 3)).chunks())
        mine = np.concatenate([c.offsets for c in head + rest] + [np.array([o for _, o, _ in c.rejected], np.int64) for c in head + rest])
        assert len(mine) == len(np.unique(mine))
        assert set(((mine // (group_rows or 64)) % 3).tolist()) == {rank}  # its row groups, or its stripes
        seen.append(mine)
    everything = np.sort(np.concatenate(seen))
    assert np.array_equal(everything, np.arange(table.num_rows))


# ---------------------------------------------------------------- the CLI on several ranks
# the planner replicates the small tables (estimated below the threshold) and shards user and item
REPLICATE_SMALL = {"STREAMREC_TRAINER__TABLE_ROWS": "category=2000,advertiser=20000,context=500,user=50000000,item=20000000",
                   "STREAMREC_TRAINER__REPLICATE_BELOW_ROWS": "100000"}
SMALL_TABLES = ["category", "advertiser", "context"]


@pytest.fixture(scope="module")
def runs(two_ranks_run, same_steps_run, tmp_path_factory) -> tuple[Path, dict, dict]:
    """One rank at batch 1024 and conftest's two ranks at 512 each (the same 1024 samples per
    step), over every sample of the file: (the two ranks' directory, one's summary, two's)."""
    one = train_cli(tmp_path_factory.mktemp("one_rank"), same_steps_run, "--batch-size", "1024")
    assert one.returncode == 0, one.stderr[-3000:]
    return two_ranks_run[0], json.loads(one.stdout), two_ranks_run[1]


@pytest.fixture(scope="module")
def replicated_run(same_steps_run, tmp_path_factory) -> tuple[Path, dict]:
    """The two-rank run of ``runs`` again, with the small tables replicated on both ranks:
    (its directory, its summary)."""
    root = tmp_path_factory.mktemp("replicated")
    done = train_cli(root, same_steps_run, "--batch-size", "512", "--nproc-per-node", "2", env=REPLICATE_SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, json.loads(done.stdout)


@pytest.mark.slow
def test_two_ranks_learn_as_well_as_one_on_the_same_data(runs, same_steps_run):
    _, one, two = runs
    rows = pq.ParquetFile(same_steps_run).metadata.num_rows
    assert one["samples"] == two["samples"] == rows
    assert sum(r["samples"] for r in two["ranks"]) == rows
    print({"auc_one": one["auc_online"], "auc_two": two["auc_online"]})
    # the same steps (the file's row groups divide each rank's batch): within 0.005 (the runs
    # differ by the order of floating-point sums alone)
    assert abs(one["auc_online"] - two["auc_online"]) < 0.005
    # both ranks trained, and the rows are spread evenly
    shares = [sum(r["table_rows"].values()) for r in two["ranks"]]
    assert min(shares) > 0.9 * max(shares), shares
    assert sum(two["table_rows"].values()) == sum(one["table_rows"].values())  # the same keys, each on one rank
    # each rank's step figures: its samples, and what its exchange sent the other
    by_rank = two["step_by_rank"]
    assert [r["rank"] for r in by_rank] == [0, 1] and sum(r["samples"] for r in by_rank) == rows
    assert all(r["exchange"]["bytes_out"]["rows"] > 0 and r["exchange"]["ids_received"] > 0 for r in by_rank)
    assert all(r["exchange"]["counts_exchanged"] == 0 for r in by_rank)  # the split sizes came with the agreement
    assert all(r["exchange"]["keys_agreed"] == r["exchange"]["steps"] > 0 for r in by_rank)  # and so did the keys
    assert [r["samples"] for r in one["step_by_rank"]] == [rows] and "exchange" not in one["step_by_rank"][0]


@pytest.mark.slow
def test_small_tables_replicated_on_every_rank_learn_as_the_sharded_run(runs, replicated_run, same_steps_run, tmp_path):
    """Two ranks with category, advertiser and context replicated (the planner, from their
    estimated rows) and user and item sharded: every sample trained, online AUC within 0.01
    of the all-sharded run's, the same keys in every table of the last version (one file per
    replicated table, the placement in its manifest), the replicated tables the same on both
    ranks row for row, and a resume with another placement refused."""
    sharded_dir, _, two = runs
    replicated_dir, replicated = replicated_run
    rows = pq.ParquetFile(same_steps_run).metadata.num_rows
    assert replicated["samples"] == rows
    print({"auc_sharded": two["auc_online"], "auc_replicated": replicated["auc_online"]})
    assert abs(two["auc_online"] - replicated["auc_online"]) < 0.01
    by_rank = replicated["step_by_rank"]
    assert all(r["exchange"]["replicated_rows"] > 0 and r["exchange"]["counts_exchanged"] == 0 for r in by_rank)
    assert all(r["exchange"]["keys_agreed"] == 0 for r in by_rank)  # laid out on the device: the exchange sends them
    assert replicated["table_rows"] == two["table_rows"]  # a replicated table's rows counted once, not once per rank

    manifest = json.loads((replicated_dir / "models" / "ctr" / "versions" / f"{replicated['version']:012d}" /
                           "manifest.json").read_text())
    assert manifest["placement"] == {"user": "sharded", "item": "sharded", **dict.fromkeys(SMALL_TABLES, "replicated")}
    for table in manifest["placement"]:
        files = [f for f, info in manifest["files"].items() if info.get("table") == table]
        assert len(files) == (1 if table in SMALL_TABLES else 2), (table, files)
    versions = {name: ModelStore(str(path / "models"), "ctr").load() for name, path in (("two", sharded_dir), ("replicated", replicated_dir))}
    for table, (keys, _) in versions["two"].tables.items():
        got = versions["replicated"].tables[table][0]
        assert len(got) == len(np.unique(got)) and np.array_equal(np.sort(got), np.sort(keys)), table

    (rows_0, _, _), (rows_1, _, _) = _final_state(replicated_dir / "work")
    for table in SMALL_TABLES:
        assert rows_0[table].keys() == rows_1[table].keys() and len(rows_0[table]) > 0, table
        for k, (w, s, seen) in rows_0[table].items():
            assert torch.equal(rows_1[table][k][0], w) and torch.equal(rows_1[table][k][1], s) and rows_1[table][k][2] == seen
    for table in ("user", "item"):
        assert not rows_0[table].keys() & rows_1[table].keys(), table  # sharded: each key on one rank

    again = run_cli("train", "--samples", str(same_steps_run), "--model-store", str(tmp_path / "models"), "--work-dir",
                    str(replicated_dir / "work"), "--device", "cpu", "--no-frozen", "--nproc-per-node", "2", timeout=300)
    assert again.returncode != 0 and "trained with table placement" in again.stderr, again.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["two", "replicated"])
def test_a_version_written_by_two_ranks_serves_the_ranks_scores(runs, replicated_run, sample_run, name):
    """All tables sharded, or the small ones replicated (written by rank 0 alone)."""
    root, summary = (runs[0], runs[2]) if name == "two" else replicated_run
    store_root = root / "models"
    manifest = json.loads((store_root / "ctr" / "versions" / f"{summary['version']:012d}" / "manifest.json").read_text())
    assert manifest["shards"] == 2 and any(f.endswith("00001-of-00002.arrow") for f in manifest["files"])
    replicated = [t for t, where in manifest.get("placement", {}).items() if where == "replicated"]
    assert (name == "replicated") == bool(replicated)

    # the ranks' parameters, from their final checkpoints: every shard's rows (a replicated
    # table's from rank 0, which holds all of them) and the dense model
    configs, merged = None, {}
    for rank in range(2):
        ckpt = Checkpointer(root / "work" / "ctr" / "checkpoints" / f"rank-{rank:05d}-of-00002").latest()
        shard, _ = EmbeddingCollection.restore(ckpt / "sparse")
        configs = configs or [TableConfig(t.config.name, t.config.dim) for t in shard.tables.values()]
        for name_, table in shard.tables.items():
            if rank and name_ in replicated:
                continue
            for keys, values in table.export_all():
                merged.setdefault(name_, []).append((keys, values))
        shard.close()
        state = json.loads((ckpt / "state.json").read_text())
        dense = torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=False)["model"]
    store = EmbeddingCollection(configs)
    for name_, parts in merged.items():
        store[name_].load_rows(torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts]))
    model = CTRModel(ModelSpec.from_json(state["model_spec"]))
    model.load_state_dict(dense)
    model.eval()
    instances = pq.read_table(sample_run / "samples.parquet").slice(50_000, 32).drop(["label", "click_ts"])
    batch = batch_from_table(instances, FeatureSpec(), model.spec.history_len, with_labels=False)
    with torch.no_grad():
        inputs = SparseFeatures(store).lookup(batch, batch.max_ts())
        want = torch.sigmoid(model(*inputs.as_args())).numpy()

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "serve", "--model-store", str(store_root), "--port", str(port),
                             "--device", "cpu", "--compile", "eager", "--workers", "1"], cwd=REPO,
                            env={**os.environ, "STREAMREC_SERVING__FEATURE_STORE": "false"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "not ready"
            time.sleep(0.2)
        request = urllib.request.Request(base + "/v1/models/ctr:predict", method="POST", headers={"content-type": "application/json"},
                                         data=json.dumps({"instances": instances.to_pylist()}).encode())
        with urllib.request.urlopen(request, timeout=30) as r:
            body = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert body["model_version"] == summary["version"]
    np.testing.assert_allclose(body["scores"], want, rtol=0, atol=1e-6)


def _worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes."""
    out = {}
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in kv)
        if "RANK" in environ:
            out[int(environ["RANK"])] = int(child)
    return out


@pytest.mark.slow
def test_a_killed_rank_fails_cleanly_and_a_restart_ends_where_an_unbroken_run_ends(runs, same_steps_run, tmp_path):
    unbroken, _, two = runs
    work = tmp_path / "work"
    args = [sys.executable, "-m", "streamrec.cli", "train", "--samples", str(same_steps_run), "--model-store", str(tmp_path / "models"),
            "--work-dir", str(work), "--device", "cpu", "--no-frozen", "--publish-interval", "3", "--json", "--batch-size", "512",
            "--nproc-per-node", "2", "--checkpoint-interval", "0.5"]
    env = {**os.environ, "STREAMREC_TRAINER__EVAL_WINDOW": "1000000", "STREAMREC_TRAINER__COLLECTIVE_TIMEOUT_S": "30"}
    launcher = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpointers = [Checkpointer(work / "ctr" / "checkpoints" / f"rank-{rank:05d}-of-00002") for rank in range(2)]
    deadline = time.monotonic() + 300
    # the kill lands after a checkpoint of both ranks with samples in it (a run starts with
    # one of step 0, after which a restart would merely start over), before the run ends
    while not all(any(step > 0 for step in c.steps()) for c in checkpointers):
        assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before a checkpoint with samples"
        time.sleep(0.05)
    pids = _worker_pids(launcher.pid)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert time.monotonic() - killed_at < 60  # the survivor stopped; it did not wait forever
    assert "rank 1 (killed by SIGKILL)" in err and "run the same command again to resume" in err, err[-2000:]
    assert out.strip() == ""  # no summary: the run did not finish
    # the window was hit: the ranks hold a common checkpoint from mid-run, and the restart resumes from it
    common = max(set(checkpointers[0].steps()) & set(checkpointers[1].steps()))
    at_kill = json.loads((checkpointers[0].at(common) / "state.json").read_text())
    assert common > 0 and 0 < at_kill["global_samples"] < two["samples"], (common, at_kill["global_samples"])

    resumed = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from ckpt-{common:012d}: step {common}," in resumed.stderr, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["samples"] == two["samples"]  # every sample trained once over the two runs
    _assert_same_final_state(work, unbroken / "work")  # docs/distributed.md: exactly the unbroken run's

    # the checkpoints are per rank: a run with another number of ranks is refused, clearly
    other = run_cli("train", "--samples", str(same_steps_run), "--model-store", str(tmp_path / "models"), "--work-dir", str(work),
                    "--device", "cpu", "--no-frozen")
    assert other.returncode != 0 and "written by 2 rank(s)" in other.stderr and "--nproc-per-node 2" in other.stderr


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie its parent has not reaped yet has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_once_they_waited_the_collective_timeout(same_steps_run, tmp_path):
    """docs/distributed.md, a rank that hangs: rank 1 frozen mid-run (SIGSTOP: its connections
    stay open, so only the timeout can tell) stops rank 0 at its next collective once that has
    waited ``collective_timeout_s``, with an error naming rank 0 and the timeout, exit 3; the
    launcher then kills the frozen rank (SIGTERM cannot stop it: SIGKILL after torch's shutdown
    timeout, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s unless set: 2 s here) and exits 1."""
    timeout_s = 10  # above any step or publish on a loaded machine, so only the hang trips it
    log = tmp_path / "launcher.log"  # a file, not a pipe: a rank blocked on a full pipe would hang too
    args = [sys.executable, "-m", "streamrec.cli", "train", "--samples", str(same_steps_run), "--loop", "--model-store",
            str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"), "--device", "cpu", "--no-frozen", "--no-announce",
            "--publish-interval", "0.5", "--batch-size", "512", "--nproc-per-node", "2"]
    store, pids = ModelStore(str(tmp_path / "models"), "ctr"), {}
    with open(log, "w") as sink:
        launcher = subprocess.Popen(args, cwd=REPO, env={**os.environ, "STREAMREC_TRAINER__COLLECTIVE_TIMEOUT_S": str(timeout_s),
                                                                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"},
                                    stdout=subprocess.DEVNULL, stderr=sink)
    try:
        deadline = time.monotonic() + 300
        while store.latest() is None:  # both ranks are in the loop: they wrote a version together
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        pids = _worker_pids(launcher.pid)
        os.kill(pids[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        while _running(pids[0]):
            assert time.monotonic() - frozen_at < timeout_s + 120, "rank 0 is still waiting for the frozen rank"
            time.sleep(0.05)
        gave_up_after = time.monotonic() - frozen_at
        launcher.wait(timeout=120)
    finally:
        for pid in pids.values():  # the frozen rank, should the launcher not have killed it
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    err = log.read_text()
    assert timeout_s <= gave_up_after < timeout_s + 60, gave_up_after  # it waited the timeout, then stopped
    # in the step's agreement (which names the rank that did not answer) or a gloo collective of the step
    assert re.search(rf"streamrec: error: rank 0: (another rank stopped answering \(rank 1 did not answer within {timeout_s} s\)"
                     rf"|a collective failed \(.*Timed out waiting {timeout_s * 1000}ms)", err), err[-3000:]
    assert "streamrec train: rank 0 (exit code 3" in err and "rank 1 (killed by SIGKILL)" in err, err[-3000:]
    assert launcher.returncode == 1 and not _running(pids[1]) and "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return make_sample_run(tmp_path_factory.mktemp("small") / "run", 10)


def _final_state(work: Path) -> list[tuple[dict, dict, dict]]:
    """Per rank, from its last checkpoint: every row (weights, optimizer state, clock), the
    dense model and optimizer state, and state.json."""
    out = []
    for rank in range(2):
        ckpt = Checkpointer(work / "ctr" / "checkpoints" / f"rank-{rank:05d}-of-00002").latest()
        store, _ = EmbeddingCollection.restore(ckpt / "sparse")
        rows = _rows_of(store)
        store.close()
        out.append((rows, torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=False),
                    json.loads((ckpt / "state.json").read_text())))
    return out


def _assert_same_final_state(got: Path, want: Path) -> None:
    """The two runs' last checkpoints hold, rank by rank, the same step and positions and bit
    for bit the same rows (weights, optimizer state, clocks) and dense model and Adam state."""
    for rank, ((rows, dense, state), (want_rows, want_dense, want_state)) in enumerate(zip(_final_state(got), _final_state(want))):
        assert state["step"] == want_state["step"] and state["positions"] == want_state["positions"], rank
        assert rows.keys() == want_rows.keys(), rank
        for table, expected in want_rows.items():
            assert rows[table].keys() == expected.keys() and len(expected) > 0, (rank, table)
            for k, (w, s, seen) in expected.items():
                row = rows[table][k]
                assert torch.equal(row[0], w) and torch.equal(row[1], s) and row[2] == seen, (rank, table, k)
        for key, value in want_dense["model"].items():
            assert torch.equal(dense["model"][key], value), (rank, key)
        for param, param_state in want_dense["optimizer"]["state"].items():
            for key, value in param_state.items():
                assert torch.equal(torch.as_tensor(dense["optimizer"]["state"][param][key]), torch.as_tensor(value)), (rank, param, key)


@pytest.mark.slow
def test_the_pipelined_trainer_ends_where_the_unpipelined_one_ends(small_run, tmp_path):
    """`streamrec train` on 2 ranks over the same samples with ``trainer.pipeline_exchange``
    on and off, publishing every 0.2 s (a step before a publish does not look ahead): the
    same samples, and bit for bit the same last version, rows (weights, optimizer state,
    clocks) and dense model and optimizer state on each rank."""
    runs = {}
    for pipelined in (True, False):
        name = "pipelined" if pipelined else "in_turn"
        done = run_cli("train", "--samples", str(small_run), "--model-store", str(tmp_path / name / "models"), "--work-dir",
                       str(tmp_path / name / "work"), "--device", "cpu", "--no-frozen", "--publish-interval", "0.2", "--json",
                       "--batch-size", "512", "--nproc-per-node", "2",
                       env={"STREAMREC_TRAINER__PIPELINE_EXCHANGE": str(pipelined).lower(), "OMP_NUM_THREADS": "1"}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = json.loads(done.stdout)
    rows = pq.ParquetFile(small_run / "samples.parquet").metadata.num_rows
    assert runs["pipelined"]["samples"] == runs["in_turn"]["samples"] == rows
    ahead = [r["exchange"]["ahead"] for r in runs["pipelined"]["step_by_rank"]]
    steps = runs["pipelined"]["step_by_rank"][0]["steps"]
    assert 0 < ahead[0] == ahead[1] < steps, (ahead, steps)  # most steps looked ahead; the first could not
    assert [r["exchange"]["found_ahead"] for r in runs["pipelined"]["step_by_rank"]] == ahead
    assert all(r["exchange"]["ahead"] == 0 for r in runs["in_turn"]["step_by_rank"])
    assert all(r["exchange"]["counts_exchanged"] == 0 for run in runs.values() for r in run["step_by_rank"])  # agreed split sizes

    last = {name: ModelStore(str(tmp_path / name / "models"), "ctr").load() for name in runs}
    for table, (keys, values) in last["in_turn"].tables.items():
        got_keys, got_values = last["pipelined"].tables[table]
        order, got_order = np.argsort(keys), np.argsort(got_keys)
        assert np.array_equal(got_keys[got_order], keys[order]) and np.array_equal(got_values[got_order], values[order]), table
    for name, value in last["in_turn"].dense.items():
        assert torch.equal(last["pipelined"].dense[name], value), name
    _assert_same_final_state(tmp_path / "pipelined" / "work", tmp_path / "in_turn" / "work")
