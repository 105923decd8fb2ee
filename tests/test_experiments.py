"""Experiments (streamrec/serving/access/experiments.py) and their records in the model store
(streamrec/modelstore/experiments.py): stable assignment, shares, layers, shadowing, run-time
changes seen by every node and after a restart, malformed bodies."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from streamrec.modelstore.experiments import ExperimentStore
from streamrec.plumbing.config import ExperimentEntry, VariantEntry, load_config, served_model_names
from streamrec.serving.access.experiments import OUTSIDE, Experiments, bucket, buckets, entry_from_json, entry_to_json
from tests.conftest import REPO, S3_BUCKET

MODELS = ["ctr", "ctr_wide", "ctr_deep"]
USERS = np.arange(100_000, dtype=np.int64)


def _experiment(name: str, shares=(0.5, 0.5), **kw) -> ExperimentEntry:
    models = ["ctr", "ctr_wide", "ctr_deep"]
    variants = tuple(VariantEntry(f"v{i}", models[i], s) for i, s in enumerate(shares))
    return ExperimentEntry(name=name, variants=variants, **kw)


def _variants(exps: Experiments, name: str, users=USERS) -> np.ndarray:
    return np.array([exps.assign(name, int(u), str(u)).variant for u in users])


def test_bucket_is_the_same_in_another_process_and_matches_the_vectorised_form():
    code = ("import numpy as np, sys; from streamrec.serving.access.experiments import bucket\n"
            "sys.stdout.write(np.array([bucket('layer-a', u) for u in range(100000)]).tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    elsewhere = np.frombuffer(bytes.fromhex(out), dtype=np.float64)
    here = buckets("layer-a", USERS)
    np.testing.assert_array_equal(elsewhere, here)
    assert ((here >= 0) & (here < 1)).all()
    # pinned values: a change of the hash would move every user to another variant
    assert bucket("layer-a", 0) == here[0]
    assert [round(bucket("layer-a", u), 12) for u in (0, 1, 2)] == [round(float(x), 12) for x in here[:3]]
    assert round(bucket("a", 1), 12) == 0.107427775181 and round(bucket("a", -1), 12) == 0.057629303967
    np.testing.assert_array_equal(buckets("a", np.array([-1, 2**62])), [bucket("a", -1), bucket("a", 2**62)])
    np.testing.assert_array_equal(buckets("a", np.array([2**64 - 1], dtype=np.uint64)), [bucket("a", -1)])


def test_the_docs_example_config_serves_a_50_50_experiment(tmp_path):
    doc = (REPO / "docs" / "experiments.md").read_text()
    path = tmp_path / "streamrec.toml"
    path.write_text(doc.split("```toml\n", 1)[1].split("```", 1)[0])
    config = load_config(path, environ={})
    exps = Experiments(config.serving.experiments, served_model_names(config))
    got = _variants(exps, "wide_vs_base")
    assert abs((got == "control").mean() - 0.5) < 0.01 and set(got) == {"control", "wide"}


def test_realised_shares_are_within_one_percent_for_100k_users():
    exps = Experiments([_experiment("e", (0.2, 0.3, 0.5))], MODELS)
    got = _variants(exps, "e")
    for variant, share in (("v0", 0.2), ("v1", 0.3), ("v2", 0.5)):
        assert abs((got == variant).mean() - share) < 0.01, variant
    a = exps.assign("e", 7, "r")
    assert a.experiment == "e" and a.model == {"v0": "ctr", "v1": "ctr_wide", "v2": "ctr_deep"}[a.variant]
    assert a.shadow_model is None


def test_users_outside_the_range_are_served_by_the_control_and_reported_outside():
    exps = Experiments([_experiment("e", range_start=0.25, range_end=0.75)], MODELS)
    got = _variants(exps, "e")
    assert abs((got == OUTSIDE).mean() - 0.5) < 0.01
    assert abs((got == "v0").mean() - 0.25) < 0.01 and abs((got == "v1").mean() - 0.25) < 0.01
    outside = next(int(u) for u, v in zip(USERS, got) if v == OUTSIDE)
    assert exps.assign("e", outside, "r").model == "ctr"


def test_experiments_of_one_layer_never_share_a_user_and_other_layers_are_independent():
    exps = Experiments([_experiment("a", layer="L", range_start=0.0, range_end=0.3),
                        _experiment("b", layer="L", range_start=0.3, range_end=0.7),
                        _experiment("c", layer="M")], MODELS)
    a, b, c = _variants(exps, "a"), _variants(exps, "b"), _variants(exps, "c")
    assert not ((a != OUTSIDE) & (b != OUTSIDE)).any()
    assert abs((a != OUTSIDE).mean() - 0.3) < 0.01 and abs((b != OUTSIDE).mean() - 0.4) < 0.01
    # layer M's split is independent of layer L's: each cell is the product of its margins
    for va in ("v0", "v1", OUTSIDE):
        for vc in ("v0", "v1"):
            joint = ((a == va) & (c == vc)).mean()
            assert abs(joint - (a == va).mean() * (c == vc).mean()) < 0.005, (va, vc)
    assert np.corrcoef(buckets("L", USERS), buckets("M", USERS))[0, 1] ** 2 < 1e-4


def test_a_layer_shares_its_salt_and_refuses_overlapping_ranges():
    with pytest.raises(ValueError, match="overlaps 'a'"):
        Experiments([_experiment("a", layer="L", range_end=0.5), _experiment("b", layer="L", range_start=0.4)], MODELS)
    with pytest.raises(ValueError, match="experiments of one layer share its salt"):
        Experiments([_experiment("a", layer="L", range_end=0.5), _experiment("b", layer="L", salt="x", range_start=0.5)], MODELS)


def test_shadow_share_of_requests_is_shadowed_and_the_same_request_decides_alike():
    exps = Experiments([_experiment("e", shadow_model="ctr_deep", shadow_share=0.1)], MODELS)
    shadowed = [exps.assign("e", 1, f"req-{i}").shadow_model for i in range(100_000)]
    assert set(shadowed) == {None, "ctr_deep"}
    assert abs(shadowed.count("ctr_deep") / len(shadowed) - 0.1) < 0.005
    assert all(exps.assign("e", 2, f"req-{i}").shadow_model == shadowed[i] for i in range(100))


def test_unknown_experiment_and_problems_of_a_put():
    exps = Experiments([_experiment("e")], MODELS)
    with pytest.raises(KeyError):
        exps.assign("nope", 1, "r")
    with pytest.raises(KeyError):
        exps.get("nope")
    with pytest.raises(ValueError, match=r"model\(s\) \['gone'\] not served"):
        exps.put(ExperimentEntry("f", (VariantEntry("a", "gone", 1.0),)))
    with pytest.raises(ValueError, match="add up to 1"):
        exps.put(_experiment("f", (0.5, 0.6)))
    with pytest.raises(ValueError, match="no variant may be named 'outside'"):
        exps.put(ExperimentEntry("f", (VariantEntry(OUTSIDE, "ctr", 1.0),)))
    with pytest.raises(ValueError, match="invalid experiment name 'a/b'"):
        exps.put(_experiment("a/b"))
    assert exps.names() == ["e"]


def test_put_and_delete_reach_a_second_node_and_survive_a_restart(tmp_path):
    root = str(tmp_path / "models")
    configured = [_experiment("base"), _experiment("gone")]
    node1, node2 = (Experiments(configured, MODELS, ExperimentStore(root)) for _ in range(2))
    node1.put(_experiment("new", (0.1, 0.9)))
    node1.put(_experiment("base", (0.9, 0.1)))
    node1.delete("gone")
    assert node1.names() == ["base", "new"]
    assert node2.names() == ["base", "gone"]  # until its next poll
    node2.refresh()
    assert node2.names() == ["base", "new"] and node2.get("new") == node1.get("new") == _experiment("new", (0.1, 0.9))
    assert node2.get("base").variants[0].share == 0.9
    users = USERS[:2000]
    assert (_variants(node1, "new", users) == _variants(node2, "new", users)).all()
    restarted = Experiments(configured, MODELS, ExperimentStore(root))
    assert restarted.names() == ["base", "gone"]
    restarted.refresh()
    assert restarted.as_json() == node1.as_json()
    view = restarted.as_json()
    assert view["deleted"] == ["gone"] and view["ignored"] == {}
    assert [(e["name"], e["source"]) for e in view["experiments"]] == [("base", "store"), ("new", "store")]
    assert sorted(p.name for p in (tmp_path / "models" / "_experiments").iterdir()) == ["base.json", "gone.json", "new.json"]
    node2.put(_experiment("gone", (0.3, 0.7)))  # a put brings a deleted experiment back
    restarted.refresh()
    assert restarted.get("gone").variants[0].share == 0.3


def test_a_record_this_node_cannot_serve_is_ignored_and_reported(tmp_path):
    root = str(tmp_path / "models")
    other = Experiments([], ["ctr", "ctr_wide", "ctr_other"], ExperimentStore(root))
    other.put(ExperimentEntry("x", (VariantEntry("a", "ctr_other", 1.0),)))
    ExperimentStore(root).put("y", {"name": "y", "variants": "no"})
    node = Experiments([_experiment("e")], MODELS, ExperimentStore(root))
    node.refresh()
    assert node.names() == ["e"]
    assert set(node.ignored) == {"x", "y"} and "not served by this node" in node.ignored["x"]
    assert "'variants' must be a list" in node.ignored["y"]


def test_an_unreachable_store_changes_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    node = Experiments([_experiment("e")], MODELS, ExperimentStore(str(blocker)))
    with pytest.raises(OSError):
        node.put(_experiment("f"))
    with pytest.raises(OSError):
        node.delete("e")
    assert node.names() == ["e"]



def test_an_unreadable_record_is_ignored_on_every_node_and_the_others_are_served(tmp_path):
    """A record that is not JSON, or JSON nested past the parser's stack, neither stops the
    re-reads nor splits the nodes (issue 55): each is ignored, with why, and a configured
    experiment of its name is hidden alike on every node."""
    store = ExperimentStore(str(tmp_path / "models"))
    store.put("f", entry_to_json(_experiment("f")))
    folder = tmp_path / "models" / "_experiments"
    (folder / "g.json").write_text("{half")
    (folder / "e.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    nodes = [Experiments([_experiment("e")], MODELS, ExperimentStore(str(tmp_path / "models"))) for _ in range(2)]
    nodes[0].refresh()
    nodes[0].put(_experiment("h"))
    nodes[1].refresh()
    for node in nodes:
        assert node.names() == ["f", "h"]
        assert "g.json is not valid JSON" in node.ignored["g"] and "e.json is JSON nested too deeply" in node.ignored["e"]
    nodes[1].delete("g")  # an ignored record may be deleted: its tombstone replaces it
    nodes[0].refresh()
    assert set(nodes[0].ignored) == {"e"} and nodes[0].names() == ["f", "h"]


def test_entry_json_round_trip_and_malformed_bodies():
    entry = _experiment("e", layer="L", range_start=0.1, range_end=0.6, shadow_model="ctr_deep", shadow_share=0.2)
    assert entry_from_json(json.loads(json.dumps(entry_to_json(entry)))) == entry
    assert entry_from_json({"variants": [{"name": "a", "model": "ctr", "share": 1}]}, name="p").name == "p"
    cases = {
        "the body must be a JSON object, got [1]": [1],
        "unknown key(s) 'varaints' (known:": {"name": "e", "varaints": []},
        "missing key 'variants'": {"name": "e"},
        "missing key 'name'": {"variants": []},
        "'range_start' must be a finite number, got '0.5'": {"name": "e", "variants": [], "range_start": "0.5"},
        "'shadow_share' must be a finite number, got True": {"name": "e", "variants": [], "shadow_share": True},
        "'layer' must be a string, got 3": {"name": "e", "variants": [], "layer": 3},
        "variants[0] must be a JSON object, got 'ctr'": {"name": "e", "variants": ["ctr"]},
        "unknown key(s) 'variants[0].weight'": {"name": "e", "variants": [{"name": "a", "model": "m", "weight": 1}]},
        "missing key 'variants[0].share'": {"name": "e", "variants": [{"name": "a", "model": "m"}]},
        "'variants[1].share' must be a finite number, got nan": {"name": "e", "variants": [
            {"name": "a", "model": "m", "share": 1}, {"name": "b", "model": "m", "share": float("nan")}]},
    }
    for message, body in cases.items():
        with pytest.raises(ValueError) as err:
            entry_from_json(body)
        assert message in str(err.value), (body, str(err.value))
    with pytest.raises(ValueError, match="'name' is 'x' but the path names 'e'"):
        entry_from_json({"name": "x", "variants": []}, name="e")


def test_records_on_an_object_store(s3_endpoint):
    root = f"s3://{S3_BUCKET}/exp?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
    assert ExperimentStore(root).load() == {}
    node1, node2 = (Experiments([_experiment("base")], MODELS, ExperimentStore(root)) for _ in range(2))
    node1.put(_experiment("new"))
    node1.delete("base")
    node2.refresh()
    assert node2.names() == ["new"] and node2.as_json() == node1.as_json()


def test_a_put_that_the_rebuilt_set_would_not_serve_is_refused_and_writes_nothing(tmp_path):
    x = ExperimentEntry("x", (VariantEntry("c", "m1", 0.5), VariantEntry("t", "m2", 0.5)), layer="L", range_end=0.5)
    book = Experiments([x], ["m1", "m2"], ExperimentStore(str(tmp_path)))
    book.delete("x")
    book.put(entry_from_json({"variants": [{"name": "c", "model": "m1", "share": 1.0}], "layer": "L", "range_end": 0.5}, name="a"))
    (tmp_path / "_experiments" / "x.json").unlink()  # the configured x is back: it is taken first, "a" is ignored
    book.refresh()
    assert book.names() == ["x"] and "a" in book.ignored
    stored = sorted(p.name for p in (tmp_path / "_experiments").iterdir())
    with pytest.raises(ValueError, match="overlaps 'a'"):  # a PUT of x would bring "a" back and push x out on every node
        book.put(entry_from_json({"variants": [{"name": "c", "model": "m1", "share": 0.8}, {"name": "t", "model": "m2", "share": 0.2}],
                                  "layer": "L", "range_end": 0.5}, name="x"))
    assert book.names() == ["x"] and sorted(p.name for p in (tmp_path / "_experiments").iterdir()) == stored
