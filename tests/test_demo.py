"""`streamrec demo`, the README's main job: the whole loop on a short run, against the
session's broker, asserting what the demo claims (issue 7)."""

import json
import os

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def _processes_with_env(needle: bytes) -> list[int]:
    """PIDs whose environment mentions ``needle`` (every process of a demo run has its topics there)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_short_demo_runs_the_loop_and_cleans_up(broker, tmp_path):
    run = run_cli("demo", "--bootstrap", broker, "--duration", "60", "--publish-interval", "8", "--drain", "20",
                  "--warmup-samples", "1000",
                  "--report-dir", str(tmp_path / "reports"), "--work-dir", str(tmp_path / "work"), timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (run_dir,) = list((tmp_path / "reports").iterdir())
    result = json.loads((run_dir / "run.json").read_text())

    t = result["throughput"]
    assert t["events"] > 60 * 300 * 0.8 and t["samples"] > 0.5 * t["events"] and t["dlq"] > 0  # samples flow
    # valid events behind the watermark are lost to training: a few at most (an overloaded
    # machine - e.g. Kafka consumers spinning - lost 20-30% here, docs/demo.md)
    assert t["dlq_reasons"].get("late_event", 0) < 0.05 * t["events"], t["dlq_reasons"]
    assert result["versions"]["published"] >= 4 and result["versions"]["applied"] >= 4  # >= 3 deltas over the first
    assert result["rollback"]["ok"], result["rollback"]
    assert result["serving"]["failed_requests"] == 0
    # the ad-server probe scored by ids; replayed at the sample's time the features are the samples' own
    skew = result["feature_skew"]
    assert "feature skew:" in run.stdout and result["serving"]["failed_requests_by_ids"] == 0
    assert skew["impressions"] > 500 and skew["replayed"]["impressions"] > 100, skew
    assert skew["replayed"]["identical_pct"] >= 99.0, skew
    assert skew["mismatched_impressions_by_reason"]["unexplained"] <= 0.01 * skew["impressions"], skew
    fresh = result["freshness"]["event_to_servable_ms"]
    assert fresh["n"] > 50 and fresh["p99"] > 0
    assert set(result["freshness"]["stages_ms"]) == {"event_to_sample", "sample_to_trained", "trained_to_published",
                                                     "published_to_applied"}
    q = result["quality"]["overall"]
    assert result["quality"]["samples"] > 2000 and {"online", "frozen", "bayes"} <= set(q)
    # scores line up with their samples: the truth ranks them far better than either model
    assert q["bayes"]["auc"] > 0.7 and q["bayes"]["auc"] > max(q["online"]["auc"], q["frozen"]["auc"]) + 0.1
    # online learning pays: on the same samples the hot-swapped model scores better than itself
    # frozen after warm-up by logloss (a proper score: ranking and calibration). The AUC gap of a
    # 60 s run is within its noise (~500 positives; it went both ways by ~0.02 in CI runs), so
    # AUC only has to stay level; longer runs show the gap (README, bench/RESULTS.md).
    assert q["online"]["logloss"] < q["frozen"]["logloss"], q
    assert q["online"]["auc"] > q["frozen"]["auc"] - 0.04, q
    assert all(p["left"] == 0 for p in result["processes"].values()), result["processes"]
    res = result["resources"]  # each stage's CPU and memory, the Flink JVM counted with the pipeline
    assert {"pipeline", "trainer", "serving", "generator", "demo (probe)"} <= set(res), res
    assert res["pipeline"]["cpu_s"] > 5 and res["pipeline"]["peak_rss_mb"] > 200, res
    assert _processes_with_env(f"demo-{result['run_id']}".encode()) == []  # no orphan: Flink's JVM, trainer, server
    assert (run_dir / "report.html").read_text().count("<svg") >= 2

    # the report re-renders from the run's data alone
    (run_dir / "report.html").unlink()
    again = run_cli("report", str(run_dir))
    assert again.returncode == 0 and (run_dir / "report.html").is_file()
