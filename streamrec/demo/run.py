"""``streamrec demo``: the whole loop on one machine, measured.

broker → generator → Flink job → samples → trainer (publishes every --publish-interval) → model store
→ serving node (hot-swaps each version) ← prediction traffic (the probe, also through a live
online-vs-frozen experiment whose answers the node logs and the demo grades). Every part runs
as its own ``streamrec`` process, exactly as a user would start it, on topics, a model
store and a Flink job of this run only (``demo-<run id>``), so runs never mix. After the
traffic ends and the last versions are applied, everything is stopped (process groups,
the Flink JVM and the broker included) and the report is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Callable

from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.pipelines.flink_rest import FlinkRest
from streamrec.modelstore.store import ModelStore
from streamrec.plumbing.bus.broker import EmbeddedBroker, free_port
from streamrec.plumbing.bus.clients import make_consumer
from streamrec.plumbing.bus.topics import delete_topics, describe_topics, ensure_topics
from streamrec.plumbing.config import Config
from streamrec.demo.analysis import answers_trained_on, by_variant, freshness, quality
from streamrec.demo.experiment import (CONNECTIONS, EXPERIMENT, LiveExperiment, check_config, experiment_line, frozen_model_name, grade_experiment,
                                       prediction_log_counts, serving_config, user_config_file)
from streamrec.demo.probe import ServingClient, ServingProbe, VersionTimeline
from streamrec.demo.processes import ManagedProcess, group_members, wait_until
from streamrec.demo.report import write_report
from streamrec.demo.resources import ResourceMonitor
from streamrec.demo.skew import CONNECTIONS as AD_SERVER_CONNECTIONS, AdServerProbe, feature_skew, probe_line, skew_line

def _healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class DemoRun:
    """One run's names, directories and child-process environment."""

    def __init__(self, cfg: Config, args: argparse.Namespace) -> None:
        self.cfg, self.args = cfg, args
        self.run_id = time.strftime("%Y%m%d-%H%M%S")
        self.prefix = f"demo-{self.run_id}"
        # absolute, so the children (started in the same directory) and the report agree on them
        self.report_dir = Path(args.report_dir).resolve() / self.run_id
        self.work_dir = Path(args.work_dir).resolve() / self.run_id
        self.log_dir = self.report_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.serve_address = f"127.0.0.1:{free_port()}"
        self.rest_port = free_port()
        self.admin_token = secrets.token_hex(16)
        self.topics = {"events": f"{self.prefix}.events", "samples": f"{self.prefix}.samples",
                       "dlq": f"{self.prefix}.events.dlq", "truth": f"{self.prefix}.truth",
                       "model_updates": f"{self.prefix}.model-updates", "features": f"{self.prefix}.features",
                       "predictions": f"{self.prefix}.predictions"}

    def feature_spec(self) -> FeatureSpec:
        """The spec every process of the run uses (the demo sets its attribution window)."""
        return dataclasses.replace(self.cfg.features, attribution_window_s=float(self.args.attribution_window))

    def serving_config(self) -> Path:
        """The serving node's config file: the online model, its frozen copy and the experiment."""
        return serving_config(self.work_dir / "serving.toml", user_config_file(getattr(self.args, "config", None)),
                              self.cfg.model.name)

    def env(self) -> dict[str, str]:
        a, store = self.args, str(self.work_dir / "models")
        env = {
            **os.environ,
            "STREAMREC_KAFKA__BOOTSTRAP": self.cfg.kafka.bootstrap_servers,
            **{f"STREAMREC_TOPICS__{k.upper()}": v for k, v in self.topics.items()},
            "STREAMREC_FLINK__GROUP_ID": self.prefix, "STREAMREC_FLINK__JOB_NAME": self.prefix,
            "STREAMREC_FLINK__CHECKPOINT_DIR": str(self.work_dir / "flink-checkpoints"),
            "STREAMREC_FLINK__REST_PORT": str(self.rest_port),
            # freshness over throughput, unless the caller chose otherwise: exactly-once samples are
            # visible at each checkpoint, a click's sample waits for the watermark and crosses
            # three network hops (bench/RESULTS.md, "Shorter publish intervals")
            **{k: os.environ.get(k, v) for k, v in (("STREAMREC_FLINK__CHECKPOINT_INTERVAL_S", "1"),
                                                     ("STREAMREC_FLINK__WATERMARK_INTERVAL_MS", "50"),
                                                     ("STREAMREC_FLINK__BUFFER_TIMEOUT_MS", "10"))},
            "STREAMREC_FEATURES__ATTRIBUTION_WINDOW_S": str(a.attribution_window),
            "STREAMREC_TRAINER__MODEL_STORE": store, "STREAMREC_TRAINER__WORK_DIR": str(self.work_dir / "trainer"),
            "STREAMREC_TRAINER__GROUP": self.prefix, "STREAMREC_TRAINER__PUBLISH_INTERVAL_S": str(a.publish_interval),
            "STREAMREC_TRAINER__WARMUP_SAMPLES": str(a.warmup_samples),
            # a version a second: deltas only, the chain compacted every 30 of them
            "STREAMREC_TRAINER__FULL_EVERY": os.environ.get("STREAMREC_TRAINER__FULL_EVERY", "100000"),
            "STREAMREC_TRAINER__COMPACT_EVERY": os.environ.get("STREAMREC_TRAINER__COMPACT_EVERY", "30"),
            "STREAMREC_SERVING__MODEL_STORE": store, "STREAMREC_SERVING__PORT": self.serve_address.rsplit(":", 1)[1],
            "STREAMREC_SERVING__ADMIN_TOKEN": self.admin_token, "STREAMREC_SERVING__POLL_INTERVAL_S": "0.5",
            "STREAMREC_SERVING__FEATURE_STORE_DIR": str(self.work_dir / "serving-features"),
            "STREAMREC_SERVING__PREDICTION_LOG": "true",  # the experiment is graded from it
            # a short run has few samples: smaller steps, a faster dense learning rate
            "STREAMREC_TRAINER__BATCH_SIZE": "256", "STREAMREC_MODEL__DENSE_LR": "0.005",
            "OMP_NUM_THREADS": "1",  # trainer and server share the cores with Flink and the broker
        }
        if getattr(a, "config", None):
            env["STREAMREC_CONFIG"] = str(Path(a.config).resolve())
        return env


@dataclasses.dataclass
class Observers:
    """What watches the run from this process: the serving probes (by instances and by ids),
    the version timeline and the processes' CPU and memory."""

    client: ServingClient
    probe: ServingProbe
    ad_server: AdServerProbe
    timeline: VersionTimeline
    monitor: ResourceMonitor


def run_demo(args: argparse.Namespace, cfg: Config) -> int:
    """Run the loop, write the report; 1 when the system misbehaved (:func:`_failures`, each
    reason printed), else 0."""
    check_config(cfg)
    k = cfg.kafka
    broker = EmbeddedBroker(k.data_dir, k.embedded_host, k.embedded_port, k.embedded_brokers, k.embedded_heap_mb)
    started_broker, run = False, None
    processes: dict[str, ManagedProcess] = {}
    started: list = []  # what watches the run, stopped in the order started
    try:
        broker_pids, started_broker = _start_broker(broker, cfg)
        run = DemoRun(cfg, args)
        _create_topics(cfg, run)
        start = _starter(run, processes)
        _start_services(run, start, processes)
        watch = _start_observers(cfg, args, run, broker_pids, processes, started)
        start_ms = int(time.time() * 1000)
        start("generator", "generate", "--duration", str(args.duration), "--rate", str(args.rate),
              "--bad-fraction", str(args.bad_fraction), "--start-ms", str(start_ms))
        print(f"[4/6] live traffic: {args.duration:g} s at ~{args.rate:g} events/s; trainer publishes every "
              f"{args.publish_interval:g} s; the probe scores every sample at the serving node, "
              f"and through the live experiment {EXPERIMENT}", flush=True)
        rollback = _drive(args, processes, watch, start_ms)

        print("[5/6] traffic done; stopping every process", flush=True)
        for observer in started:
            observer.stop()
        logged = prediction_log_counts(run.serve_address)  # before the node stops
        stopped = _stop_all(processes)
        result = _result(args, cfg, run, watch, start_ms, rollback, stopped, logged)
        paths = write_report(run.report_dir, result)
        _print_summary(result, paths)
        failures = _failures(result)
        for why in failures:
            print(f"FAILED: {why}", flush=True)
        return 1 if failures else 0
    finally:
        for observer in started:
            observer.stop()
        _stop_all(processes)
        if run is not None and not args.keep_topics:
            _delete_run_topics(k.bootstrap_servers, run)
        if started_broker and not args.keep_broker:
            broker.down()
            print("embedded broker stopped (use --keep-broker to leave it running)", flush=True)


def _start_broker(broker: EmbeddedBroker, cfg: Config) -> tuple[list[int], bool]:
    """[1/6]: the embedded Kafka up (unless the run uses an external cluster); its nodes' pids
    and whether this run started it."""
    k = cfg.kafka
    if not k.embedded:
        print(f"[1/6] using external Kafka at {k.bootstrap_servers}", flush=True)
        return [], False
    state, started_broker = broker.up(max(k.connect_timeout_s, 60.0))
    print(f"[1/6] embedded Apache Kafka {'started' if started_broker else 'already running'} at {state.bootstrap}", flush=True)
    return state.pids, started_broker


def _create_topics(cfg: Config, run: DemoRun) -> None:
    """[2/6]: the run's topics."""
    k = cfg.kafka
    # the features topic is the job's to create (compacted: pipelines/pipeline_service.py)
    ensure_topics(k.bootstrap_servers, [t for name, t in run.topics.items() if name != "features"], k.partitions,
                  k.replication_factor, k.connect_timeout_s)
    print(f"[2/6] run {run.run_id}: topics {run.prefix}.*, work dir {run.work_dir}, logs {run.log_dir}", flush=True)


def _starter(run: DemoRun, processes: dict[str, ManagedProcess]) -> Callable[..., ManagedProcess]:
    """``start(name, *argv)``: run ``streamrec <argv>`` as the run's process ``name``, with the
    run's environment and a log file of its own."""
    env = run.env()

    def start(name: str, *argv: str) -> ManagedProcess:
        return processes.setdefault(name, ManagedProcess(name, list(argv), env, run.log_dir, Path.cwd()))

    return start


def _start_services(run: DemoRun, start: Callable[..., ManagedProcess], processes: dict[str, ManagedProcess]) -> None:
    """[3/6]: the Flink job, the trainer and the serving node, until the node answers and
    every task of the job runs."""
    start("pipeline", "pipeline", "submit", "--fresh")
    start("trainer", "train")
    start("serving", "serve", "--host", "127.0.0.1", "--config", str(run.serving_config()))
    print("[3/6] starting the Flink job (embedded mini-cluster), the trainer and the serving node ...", flush=True)
    wait_until(lambda: _healthy(run.serve_address), 120, "the serving node", list(processes.values()))
    FlinkRest(f"127.0.0.1:{run.rest_port}").wait_running(run.prefix, 180, all_tasks=True)


def _start_observers(cfg: Config, args: argparse.Namespace, run: DemoRun, broker_pids: list[int],
                     processes: dict[str, ManagedProcess], started: list) -> Observers:
    """Start what watches the run; each is added to ``started`` as soon as it runs."""
    k = cfg.kafka
    monitor = ResourceMonitor(lambda: {**({"broker": broker_pids} if broker_pids else {}),
                                       **{name: p.pid for name, p in processes.items() if p.alive()},
                                       "demo (probe)": [os.getpid()]}).start()
    started.append(monitor)
    store = ModelStore(str(run.work_dir / "models"), cfg.model.name)
    client = ServingClient(run.serve_address, cfg.model.name, run.admin_token)
    live = LiveExperiment(EXPERIMENT, ModelStore(str(run.work_dir / "models"), frozen_model_name(cfg.model.name)),
                          [ServingClient(run.serve_address, cfg.model.name) for _ in range(CONNECTIONS)])
    probe = ServingProbe(k.bootstrap_servers, run.topics["samples"], run.topics["truth"], client, store,
                         args.warmup_samples, live).start()
    started.append(probe)
    ad_server = AdServerProbe(k.bootstrap_servers, run.topics["events"], run.topics["samples"],
                              [ServingClient(run.serve_address, cfg.model.name) for _ in range(AD_SERVER_CONNECTIONS)],
                              run.feature_spec()).start()
    started.append(ad_server)
    timeline = VersionTimeline(ServingClient(run.serve_address, cfg.model.name), store).start()
    started.append(timeline)
    return Observers(client, probe, ad_server, timeline, monitor)


def _result(args: argparse.Namespace, cfg: Config, run: DemoRun, watch: Observers, start_ms: int, rollback: dict,
            stopped: dict, logged: dict[str, int]) -> dict:
    """[5/6]: everything the report shows (run.json), from what the observers saw and the
    experiment's grades from the prediction log."""
    snapshot, timeline = watch.probe.snapshot(), watch.timeline
    steady_from_ms = start_ms + int(args.duration * 500)
    bootstrap = cfg.kafka.bootstrap_servers
    return {
        "run_id": run.run_id, "started_at_ms": start_ms, "duration_s": args.duration, "rate": args.rate,
        "publish_interval_s": args.publish_interval, "topics": run.topics,
        "quality": {**quality(snapshot, start_ms, timeline.manifests, steady_from_ms=steady_from_ms),
                    "experiment": _experiment(cfg, run, watch.probe, snapshot, timeline.manifests, logged)},
        "freshness": freshness(snapshot["positives"], timeline.manifests, timeline.applied, steady_from_ms=steady_from_ms),
        "versions": {"published": len(timeline.manifests), "applied": len(timeline.applied),
                     "timeline": {str(v): {**m, "applied_at": timeline.applied.get(v)} for v, m in sorted(timeline.manifests.items())}},
        "rollback": rollback,
        "feature_skew": feature_skew(watch.ad_server.snapshot(), run.feature_spec(), watch.probe.scores_by_event()),
        "ad_server_probe": watch.ad_server.report(),
        "serving": {"failed_requests": snapshot["failed_requests"], "unscored_samples": snapshot["unscored"],
                    "skipped_trained_samples": snapshot["skipped_trained"],
                    "failed_requests_by_ids": watch.ad_server.failed_requests,
                    "failed_requests_experiment": snapshot["experiment"]["failed_requests"]},
        "throughput": _throughput(bootstrap, run, args.duration, snapshot),
        "resources": watch.monitor.report(),
        "processes": stopped,
    }


def _experiment(cfg: Config, run: DemoRun, probe: ServingProbe, snapshot: dict, manifests: dict[int, dict],
                logged: dict[str, int]) -> dict:
    """The live experiment: what the probe sent, what the node logged, each variant graded from
    the log, and the same grade of the answers as the probe received them, to set beside it."""
    sent = snapshot["experiment"]
    frozen = probe.live.frozen_store.model  # a copy of the online model's version frozen_version
    trained = answers_trained_on(sent["answers"], manifests, frozen, probe.frozen_version)
    out = {"name": EXPERIMENT, "frozen_model": frozen, "frozen_version": probe.frozen_version,
           "requests": sent["requests"], "unscored_samples": sent["unscored"], "prediction_log": logged,
           "answered": by_variant(sent["answers"], trained)}
    try:
        trained_on = {(a.user_id, a.item_id, a.ts) for a, t in zip(sent["answers"], trained) if t} | sent["skipped"]
        out["graded"] = grade_experiment(cfg.kafka.bootstrap_servers, run.topics["samples"], run.topics["predictions"],
                                         run.feature_spec(), cfg.kafka.connect_timeout_s, trained_on)
    except Exception as exc:  # noqa: BLE001 - the report is still written; the run fails on it (_failures)
        out["error"] = f"the experiment could not be graded: {type(exc).__name__}: {exc}"
    return out


def _failures(result: dict) -> list[str]:
    """Why the run shows the system misbehaving, one line each (none: it succeeded): no version
    applied, a request failed (a 5xx, a 4xx other than a ts older than the node keeps, a 503
    once the node had answered), a failed rollback, an ungraded experiment, processes left
    behind. What the demo's own probes skipped because they fell behind is reported, not failed."""
    out = []
    if not result["versions"]["applied"]:
        out.append("the serving node applied no version")
    serving = result["serving"]
    for key, what in (("failed_requests", "predict requests (instances)"), ("failed_requests_by_ids", "predict requests by ids"),
                      ("failed_requests_experiment", "experiment requests")):
        if serving[key]:
            out.append(f"{serving[key]:,} {what} failed (each logged with its status)")
    rollback = result["rollback"]
    if rollback.get("done") and not rollback.get("ok"):
        out.append(f"the rollback v{rollback['from_version']} -> v{rollback['to_version']} failed (pinned held: "
                   f"{rollback['pinned_held']}, released: {rollback['released']}): {rollback['response']}")
    experiment = result["quality"]["experiment"]
    if "error" in experiment:
        out.append(experiment["error"])
    out.extend(f"{name} left {p['left']} processes running" for name, p in result["processes"].items() if p["left"])
    return out


def _delete_run_topics(bootstrap: str, run: DemoRun) -> None:
    """A run's topics are its own: none is left behind unless asked (``--keep-topics``)."""
    try:
        deleted = delete_topics(bootstrap, list(run.topics.values()))
        print(f"deleted the run's {len(deleted)} topics (use --keep-topics to keep them)", flush=True)
    except Exception as exc:  # the report is written; say what is left behind
        print(f"could not delete the run's topics {run.prefix}.* ({exc}); "
              f"delete them with `streamrec kafka prune`", flush=True)


def _drive(args: argparse.Namespace, processes: dict[str, ManagedProcess], watch: Observers, start_ms: int) -> dict:
    """Progress lines while the traffic runs; one rollback (and release) mid-run; then
    a drain so the last clicks reach a served version."""
    probe, ad_server, timeline = watch.probe, watch.ad_server, watch.timeline
    rollback: dict = {"done": False}
    t0 = time.monotonic()
    end_of_traffic = None
    last_print = 0.0
    while True:
        now = time.monotonic() - t0
        if probe.error:
            raise RuntimeError(f"the serving probe failed: {probe.error}")
        if ad_server.error:
            raise RuntimeError(f"the ad-server probe (predict by ids) failed: {ad_server.error}")
        for name in ("pipeline", "trainer", "serving"):
            processes[name].check_alive()
        gen = processes["generator"]
        if end_of_traffic is None and not gen.alive():
            if gen.proc.returncode != 0:
                gen.check_alive()
            end_of_traffic = now
        if not rollback["done"] and now > args.duration * 0.6 and len(timeline.applied) >= 2:
            rollback = _rollback_and_release(watch.client)
        if now - last_print >= args.progress_interval:
            last_print = now
            print(_progress_line(now, args.duration, probe, timeline, start_ms), flush=True)
        if end_of_traffic is not None and now - end_of_traffic > args.drain:
            return rollback
        time.sleep(0.5)


def _rollback_and_release(client: ServingClient) -> dict:
    """:rollback to the previous version (pins it), then :reload to follow LATEST again.

    From and to come from the rollback's own answer: a status read before it could be one
    version behind (the watcher applies new versions meanwhile), and the rollback would then
    seem to go from a version to itself."""
    t = time.perf_counter()
    status, body = client.rollback()
    rollback_ms = (time.perf_counter() - t) * 1000
    from_version, to_version = body.get("previous"), body.get("model_version")
    ok = status == 200 and body.get("pinned") is True and (to_version or 0) < (from_version or 0)
    time.sleep(2.0)
    after = client.status()
    pinned_held = after.get("model_version") == to_version and after.get("pinned") is True
    reload_status, _ = client.reload()
    result = {"done": True, "ok": bool(ok and pinned_held and reload_status == 200), "from_version": from_version,
              "to_version": to_version, "http_ms": round(rollback_ms, 1), "pinned_held": pinned_held,
              "released": reload_status == 200, "response": body}
    print(f"  rollback v{result['from_version']} -> v{result['to_version']} in {rollback_ms:.0f} ms over HTTP; "
          f"pinned for 2 s, then :reload -> following LATEST again ({'ok' if result['ok'] else 'FAILED'})", flush=True)
    return result


def _progress_line(now: float, duration: float, probe: ServingProbe, timeline: VersionTimeline, start_ms: int) -> str:
    snap = probe.snapshot()
    q = quality(snap, start_ms, timeline.manifests)["overall"]
    served = timeline.status.get("model_version")
    published = max(timeline.manifests) if timeline.manifests else None
    auc = " ".join(f"{name} {q[name]['auc']:.3f}" for name in ("online", "frozen", "bayes") if name in q and q[name]["auc"] is not None)
    fresh = freshness(snap["positives"], timeline.manifests, timeline.applied)["event_to_servable_ms"]
    fresh_text = f" | event->servable p50 {fresh['p50'] / 1000:.1f} s" if fresh.get("n") else ""
    return (f"  [{now:5.0f} s/{duration:.0f}] samples scored {len(snap['ts']):,} | published v{published or '-'}, "
            f"serving v{served or '-'} | AUC {auc or '-'}{fresh_text}")


def _stop_all(processes: dict[str, ManagedProcess]) -> dict:
    """Stop in dependency order (traffic, serving, trainer, Flink); report what is left."""
    out = {}
    for name in ("generator", "serving", "trainer", "pipeline"):
        p = processes.get(name)
        if p is not None:
            code = p.stop(grace_s=60 if name in ("trainer", "pipeline") else 20)
            out[name] = {"exit": code, "left": len(group_members(p.pid)), "log": str(p.log_path)}
    return out


def _throughput(bootstrap: str, run: DemoRun, duration: float, snapshot: dict) -> dict:
    topics = {t.name: t.messages for t in describe_topics(bootstrap, list(run.topics.values()))}
    return {"events": topics.get(run.topics["events"], 0), "samples": topics.get(run.topics["samples"], 0),
            "dlq": topics.get(run.topics["dlq"], 0), "dlq_reasons": _dlq_reasons(bootstrap, run.topics["dlq"]),
            "scored_at_serving": int(len(snapshot["ts"])),
            "events_per_s": round(topics.get(run.topics["events"], 0) / duration, 1)}


def _dlq_reasons(bootstrap: str, topic: str) -> dict[str, int]:
    """Rejected events by reason code (the `reason` header), most frequent first: a run
    that sent many valid events to the DLQ as late_event was overloaded (docs/demo.md)."""
    consumer = make_consumer(bootstrap, topic, group_id=None, auto_offset_reset="earliest", consumer_timeout_ms=2000,
                             isolation_level="read_committed")
    counts: Counter[str] = Counter()
    try:
        for record in consumer:
            reason = dict(record.headers or []).get("reason", b"").decode(errors="replace")
            counts[reason.split(":", 1)[0] or "?"] += 1
    finally:
        consumer.close()
    return dict(counts.most_common())


def _print_summary(result: dict, paths: dict) -> None:
    q, f = result["quality"]["overall"], result["freshness"]
    print("[6/6] summary", flush=True)
    t = result["throughput"]
    print(f"  events {t['events']:,} ({t['events_per_s']:,.0f}/s) -> samples {t['samples']:,} (+{t['dlq']:,} to the DLQ) "
          f"-> scored at the serving node {t['scored_at_serving']:,}")
    if t.get("dlq_reasons"):
        print("  DLQ by reason: " + ", ".join(f"{reason} {n:,}" for reason, n in t["dlq_reasons"].items()))
    if result.get("resources"):
        print("  CPU cores (average) / peak memory: " + ", ".join(
            f"{name} {r['avg_cores']} / {r['peak_rss_mb']:,} MB" for name, r in result["resources"].items()))
    v = result["versions"]
    print(f"  versions published {v['published']}, applied by the serving node {v['applied']}; "
          f"rollback {'ok' if result['rollback'].get('ok') else 'not done' if not result['rollback'].get('done') else 'FAILED'}")
    steady = result["quality"].get("steady", {})
    for name in ("online", "frozen", "bayes"):
        if name in q:
            late = steady.get("overall", {}).get(name)
            print(f"  serving-side {name:6s} AUC {q[name]['auc']}  logloss {q[name]['logloss']}"
                  + (f"  (second half: AUC {late['auc']}  logloss {late['logloss']})" if late else ""))
    experiment = result["quality"]["experiment"]
    print(f"  {experiment.get('error') or experiment_line(experiment)}")
    e = f["event_to_servable_ms"]
    if e.get("n"):
        print(f"  freshness (click event time -> servable), {e['n']} clicks: p50 {e['p50'] / 1000:.1f} s, p99 {e['p99'] / 1000:.1f} s")
        s = f["steady_event_to_servable_ms"]
        if s.get("n"):
            print(f"    second half of the run ({s['n']} clicks): p50 {s['p50'] / 1000:.1f} s, p99 {s['p99'] / 1000:.1f} s")
        for stage, s in f["stages_ms"].items():
            print(f"    {stage:22s} p50 {s['p50'] / 1000:6.1f} s  p99 {s['p99'] / 1000:6.1f} s")
    print(f"  {skew_line(result['feature_skew'])}")
    print(f"  {probe_line(result['ad_server_probe'])}")
    print(f"  {result['quality']['left_out_trained_on']:,} scored samples left out of the AUCs: the answering version "
          f"had already trained on them; {result['serving']['skipped_trained_samples']:,} not scored: the served "
          "version had trained on them before the probe read them")
    print(f"  report: {paths['html']}  (data: {paths['data']}; `streamrec report {paths['dir']}` re-renders it)")
