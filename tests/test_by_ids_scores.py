"""Scores by ids equal the instances form's for the same features: a by-ids batch (each
request's history shared by its candidates, looked up once) scores like the same rows sent
as full instances, alone and mixed with instance requests in one batch. On CPU here; the
same on CUDA (``gpu``) with the runtime's graph buckets."""

import random
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.model.batch import batch_from_columns
from streamrec.model.columns import FeatureColumns
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.config import load_config
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.runtime.model_runtime import ModelRuntime
from streamrec.serving.runtime.metrics import ModelMetrics, ServingMetrics
from streamrec.serving.features.online_features import OnlineFeatures
from streamrec.serving.runtime.request import InstanceDecoder
from streamrec.serving.runtime.runner import RuntimeConfig
from streamrec.serving.runtime.state import ServedModel

SPEC = FeatureSpec()


def _store_with_state(tmp_path, sample_rows) -> OnlineFeatures:
    """Feature state for the users and items of real samples: counters and click histories."""
    rng = random.Random(3)
    store = OnlineFeatures("unused:0", "t", SPEC, 64, tmp_path / "spill")
    records = []
    for row in sample_rows:
        for kind, entity in (("user", row["user_id"]), ("item", row["item_id"]), ("category", row["category_id"])):
            offsets = sorted(rng.randrange(0, 9_000) for _ in range(rng.randrange(1, 6)))
            records.append(SimpleNamespace(key=f"c/{kind}/{entity}/1000000".encode(), partition=0, offset=0,
                                           value=b'{"i":%s,"c":%s}' % (str(offsets).encode(), str(offsets[:1]).encode())))
        clicks = [[r["item_id"], r["category_id"], 1_000_000 + k] for k, r in enumerate(rng.sample(sample_rows, rng.randrange(0, 60)))]
        records.append(SimpleNamespace(key=f"h/user/{row['user_id']}".encode(), partition=0, offset=0,
                                       value=b'{"h":%s}' % str(sorted(clicks, key=lambda c: -c[2])).replace(" ", "").encode()))
    store._apply_records(records)
    return store


def _queries(rows, n_queries: int) -> list[ByIdsQuery]:
    rng = random.Random(9)
    out = []
    for q in range(n_queries):
        chosen = rng.sample(rows, rng.randrange(1, 30))
        ids = np.array([[r["item_id"], r["category_id"], r["advertiser_id"], r["position"]] for r in chosen], np.int64)
        out.append(ByIdsQuery(rows[q]["user_id"], 1_012_000 + rng.randrange(0, 2_000), rng.choice(["ios", "android"]),
                              rng.randrange(0, 24), ids, return_features=True))
    return out


def _check(served: ServedModel, features: OnlineFeatures, queries: list[ByIdsQuery], instance_rows: list[dict]) -> None:
    decoder = InstanceDecoder(SPEC, 10_000)
    current = served.current
    history_len = current.network.spec.history_len
    assembled = features.assemble_batch(queries)
    assert assembled.columns.hist_group is not None and len(assembled.columns.hist_lengths) == len(queries)
    by_ids = served.predict(batch_from_columns(assembled.columns, SPEC, history_len))[1]
    # the same rows as instances: the values the node used, one instance each
    instances = [msg for named in assembled.features for msg in named]
    columns, rejected = decoder.columns([decoder.instance(**x) for x in instances])
    assert not rejected
    as_instances = served.predict(batch_from_columns(columns, SPEC, history_len))[1]
    np.testing.assert_allclose(by_ids, as_instances, rtol=1e-5, atol=1e-6)
    # mixed with instance requests in one batch (the model runtime concatenates the parts)
    extra, _ = decoder.columns([decoder.instance(**x) for x in instance_rows])
    mixed = served.predict(batch_from_columns(FeatureColumns.concat([extra, assembled.columns]), SPEC, history_len))[1]
    np.testing.assert_allclose(mixed[len(instance_rows):], by_ids, rtol=1e-5, atol=1e-6)
    alone = served.predict(batch_from_columns(extra, SPEC, history_len))[1]
    np.testing.assert_allclose(mixed[: len(instance_rows)], alone, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(by_ids, 6).tolist())) > 1  # real, varied scores


def _rows(sample_run):
    import pyarrow.parquet as pq

    from streamrec.trainer.sources import sample_files

    table = pq.read_table(sample_files([str(sample_run)])[0]).slice(0, 300)
    return [{k: v for k, v in r.items() if k not in ("label", "click_ts")} for r in table.to_pylist()]


def test_by_ids_scores_equal_the_instances_form_on_cpu(published_model, sample_run, tmp_path):
    rows = _rows(sample_run)
    features = _store_with_state(tmp_path, rows[:120])
    served = ServedModel(ModelStore(str(published_model[0]), "ctr"), "cpu", feature_spec=SPEC)
    served.catch_up()
    _check(served, features, _queries(rows, 12), rows[200:230])
    features.close()
    served.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_by_ids_scores_equal_the_instances_form_on_cuda_with_graph_buckets(published_model, sample_run, tmp_path):
    rows = _rows(sample_run)
    features = _store_with_state(tmp_path, rows[:120])
    runtime = RuntimeConfig.from_serving(load_config(environ={}).serving)
    served = ServedModel(ModelStore(str(published_model[0]), "ctr"), "cuda", gpu_cache_rows=4096, runtime=runtime, feature_spec=SPEC)
    served.catch_up()
    _check(served, features, _queries(rows, 12), rows[200:230])
    features.close()
    served.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                                         reason="needs CUDA")])])
def test_candidates_counted_on_the_device_score_as_counted_on_the_host(published_model, sample_run, tmp_path, device):
    """The model runtime's batch with ``serving.candidate_counts`` "device" against "host": by-ids
    requests mixed with an instances request, same scores; the device mirror really used."""
    rows = _rows(sample_run)
    features = _store_with_state(tmp_path, rows[:120])
    settings = load_config(environ={}).serving
    runtime = RuntimeConfig.from_serving(settings) if device == "cuda" else None
    served = ServedModel(ModelStore(str(published_model[0]), "ctr"), device, gpu_cache_rows=4096, runtime=runtime, feature_spec=SPEC)
    served.catch_up()
    decoder = InstanceDecoder(SPEC, 10_000)
    instances, _ = decoder.columns([decoder.instance(**x) for x in rows[200:230]])
    queries = [replace(q, return_features=False) for q in _queries(rows, 12)]
    payloads = [queries[0], instances, *queries[1:]]
    outcomes = {}
    for where in ("host", "device"):
        model_runtime = ModelRuntime(served, replace(settings, candidate_counts=where), ModelMetrics(ServingMetrics(), "ctr"), features)
        outcomes[where] = model_runtime.execute(payloads)
    counted = features.counts_on(torch.device(device))
    assert counted.full_copies == 4 and counted.batches == 1  # both kinds' arenas went to the device, once
    # a request asking for its features back: the whole batch is counted on the host, same scores
    model_runtime = ModelRuntime(served, replace(settings, candidate_counts="device"), ModelMetrics(ServingMetrics(), "ctr"), features)
    asking = model_runtime.execute([replace(queries[0], return_features=True), instances, *queries[1:]])
    assert counted.batches == 1 and asking[0][1].features is not None
    for a, b in zip(outcomes["host"], asking):
        np.testing.assert_allclose(getattr(b[1], "scores", b[1]), getattr(a[1], "scores", a[1]), rtol=1e-5, atol=1e-6)
    for host, on_device in zip(outcomes["host"], outcomes["device"]):
        a, b = host[1], on_device[1]
        a, b = (getattr(a, "scores", a), getattr(b, "scores", b))
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(np.concatenate([o[1].scores for o in outcomes["device"] if hasattr(o[1], "scores")]), 6).tolist())) > 1
    features.close()
    served.close()


def test_a_device_path_that_cannot_start_leaves_the_node_counting_on_the_host(published_model, sample_run, tmp_path, monkeypatch):
    """A kernel that does not compile (a GPU or driver Triton cannot use) must not take the
    node out: it counts on the host, and says why in its status."""
    from streamrec.serving.features.device_counts import DeviceCounts

    def broken(self):
        raise RuntimeError("no kernel for this GPU")
    monkeypatch.setattr(DeviceCounts, "warm_up", broken)
    rows = _rows(sample_run)
    features = _store_with_state(tmp_path, rows[:120])
    served = ServedModel(ModelStore(str(published_model[0]), "ctr"), "cpu", feature_spec=SPEC)
    served.catch_up()
    settings = load_config(environ={}).serving
    model_runtimes = {where: ModelRuntime(served, replace(settings, candidate_counts=where), ModelMetrics(ServingMetrics(), "ctr"), features)
               for where in ("host", "device")}
    assert model_runtimes["device"].status()["candidate_counts_on_host_because"] == "RuntimeError: no kernel for this GPU"
    queries = [replace(q, return_features=False) for q in _queries(rows, 4)]
    want, got = (model_runtimes[w].execute(queries) for w in ("host", "device"))
    for a, b in zip(want, got):
        np.testing.assert_allclose(b[1].scores, a[1].scores, rtol=1e-6)
    features.close()
    served.close()
