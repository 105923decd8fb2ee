"""The Flink job's throughput and event-to-sample latency, against plain Python.

1. Backlog throughput: the generator writes N events to a fresh topic; the job (embedded
   mini-cluster, ``--bounded``) turns them into samples. Progress = the samples topic's end
   offsets, read 4x a second (Flink's REST metrics lag by seconds: timing from their first
   non-zero reading would start when a third of the backlog is already done and inflate
   every figure). Events in a window = the samples written in it x the run's
   events per sample. Whole run: from the first sample to the end (JVM and job start-up
   not counted); steady: from 25% to 90% of the samples, after the warm-up and before the
   end of input's final flush. Per core = events/s / the machine's cores; per CPU-second =
   events / the CPU time the Flink process (JVM: tasks, JIT, GC) used in the window,
   because on a small machine the job shares its cores with the broker (whose CPU time is
   reported too); and the same without the JIT compiler threads' CPU, a one-off cost that a
   backlog of a few hundred thousand events cannot amortise but a long-running job does.
   ``--repeat``: round-robin runs and medians (this box is noisy).
   Baseline, same run, same events: a kafka-python consumer feeding the exact reference
   builder (pipelines/samples.py: the same validation, join and point-in-time features).
   Backends: rocksdb (with the stages' state cache, the default), rocksdb-nocache, hashmap.
2. Sustained (``--rounds N``): N backlogs of the same size through one long-running job (each
   written as one transaction), so that millions of events pass and the JIT's warm-up is paid in the first ``--warmup-rounds``
   as in production. Per CPU-second within the rounds, and counting the pauses between them.
3. Live latency: the generator paced at ``--live-rate`` events/s while the job runs; a
   read_committed consumer notes when each positive sample becomes visible. Latency =
   that wall time - the impression's event time (and - the click's), p50/p99.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from output import write_result  # noqa: E402

from streamrec.pipelines.flink_rest import FlinkRest  # noqa: E402
from streamrec.pipelines.job import LATE_EVENT  # noqa: E402
from streamrec.contracts.feature_spec import FeatureSpec  # noqa: E402
from streamrec.pipelines.samples import SampleBuilder  # noqa: E402
from streamrec.plumbing.bus.broker import free_port  # noqa: E402
from streamrec.plumbing.bus.clients import make_admin, make_consumer  # noqa: E402
from streamrec.plumbing.bus.topics import delete_topics, list_topics  # noqa: E402
from streamrec.demo.resources import cpu_seconds, process_tree, threads_cpu_seconds  # noqa: E402


BACKENDS = {  # what --backends may name: (flink.state_backend, flink.state_cache_keys or None for the default)
    "rocksdb": ("rocksdb", None), "rocksdb-nocache": ("rocksdb", 0), "hashmap": ("hashmap", None),
}


def _env(args, name: str, tmp: Path, backend: str) -> dict:
    if backend not in BACKENDS:
        raise SystemExit(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
    state_backend, cache_keys = BACKENDS[backend]
    cache = {} if cache_keys is None else {"STREAMREC_FLINK__STATE_CACHE_KEYS": str(cache_keys)}
    return {**os.environ, **cache, "STREAMREC_KAFKA__BOOTSTRAP": args.bootstrap,
            "STREAMREC_TOPICS__EVENTS": f"{name}.events", "STREAMREC_TOPICS__SAMPLES": f"{name}.samples",
            "STREAMREC_TOPICS__FEATURES": f"{name}.features",
            "STREAMREC_TOPICS__DLQ": f"{name}.dlq", "STREAMREC_TOPICS__TRUTH": f"{name}.truth",
            "STREAMREC_FLINK__GROUP_ID": name, "STREAMREC_FLINK__JOB_NAME": name,
            "STREAMREC_FLINK__CHECKPOINT_DIR": str(tmp / name), "STREAMREC_FLINK__REST_PORT": str(free_port()),
            "STREAMREC_FLINK__STATE_BACKEND": state_backend}


def _cli(env: dict, *argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "streamrec.cli", *argv], cwd=REPO, env=env, **kw)


def _embedded_broker():
    """The embedded broker if one runs here (its CPU is part of the job's cost on this box), else None."""
    from streamrec.plumbing.config import load_config
    from streamrec.plumbing.bus.broker import EmbeddedBroker

    k = load_config().kafka
    broker = EmbeddedBroker(k.data_dir, k.embedded_host, k.embedded_port, k.embedded_brokers) if k.embedded else None
    return broker if broker and broker.status() else None


def flink_backlog(args, events_env: dict, backend: str, tmp: Path, events: int, run_index: int) -> dict:
    # a consumer group of its own per run: a repeat under the same group would start at the end
    name = f"{events_env['STREAMREC_FLINK__JOB_NAME']}-{backend}-{run_index}"
    env = {**events_env, **{k: v for k, v in _env(args, name, tmp, backend).items() if k.startswith("STREAMREC_FLINK")}}
    samples = _SamplesWritten(args.bootstrap, env["STREAMREC_TOPICS__SAMPLES"])
    started = time.monotonic()
    job = _cli(env, "pipeline", "submit", "--bounded", "--fresh", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    probe = _Probe(job.pid, args.broker_pids, samples)
    while job.poll() is None:
        probe.tick()
        time.sleep(0.25)
    ticks = probe.ticks
    output = job.stdout.read()
    if job.returncode != 0:
        raise SystemExit(f"the pipeline job failed:\n{output[-3000:]}")
    end = time.monotonic()
    total_samples = samples.count()
    samples.close()
    if not ticks:
        raise SystemExit("the job ended before its first progress reading: too few events to measure")
    ticks.append(ticks[-1]._replace(t=end, samples=total_samples))
    producing = [t for t in ticks if t.samples > 0]
    if len(producing) < 2:
        raise SystemExit("the job wrote its samples between two progress readings: too few events to measure")
    first = producing[0]
    # Flink's REST metrics lag by seconds (a third of a backlog could be done before they
    # showed any input): the samples topic is the progress signal. Each window counts the
    # events behind the samples it saw written, at the run's events per sample.
    run = {"backend": backend, "wall_s": round(end - started, 2), "startup_s": round(first.t - started, 2),
           "samples": total_samples, **_window(first, ticks[-1], total_samples, events)}
    run["steady"] = _steady(ticks, total_samples, events)
    run["progress"] = [(round(t.t - started, 2), round(t.flink_cpu, 2), t.samples) for t in ticks]
    return run


def _window(a: "_Tick", b: "_Tick", total_samples: int, events: int) -> dict:
    """Throughput and CPU between two progress readings."""
    window_events = (b.samples - a.samples) * events / total_samples
    cpu, seconds = b.flink_cpu - a.flink_cpu, b.t - a.t
    cpu_without_jit = cpu - (b.jit_cpu - a.jit_cpu)
    return {"seconds": round(seconds, 2), "events": round(window_events),
            "events_per_s": round(window_events / seconds) if seconds > 0 else None,
            "flink_cpu_s": round(cpu, 2), "jit_cpu_s": round(b.jit_cpu - a.jit_cpu, 2),
            "broker_cpu_s": round(b.broker_cpu - a.broker_cpu, 2),
            "events_per_flink_cpu_s": round(window_events / cpu) if cpu > 0 else None,
            "events_per_flink_cpu_s_without_jit": round(window_events / cpu_without_jit) if cpu_without_jit > 0 else None,
            # by thread name (15 characters: the kernel's limit), largest first
            "flink_threads_cpu_s": _thread_deltas(a.threads, b.threads)}


class _Tick(NamedTuple):
    t: float
    flink_cpu: float
    broker_cpu: float
    jit_cpu: float
    samples: int
    threads: dict


class _Probe:
    """Progress and CPU readings of a running job (its CLI process and the JVM below it)."""

    def __init__(self, job_pid: int, broker_pids: list[int], samples: "_SamplesWritten") -> None:
        self.job_pid, self.broker_pids, self.samples = job_pid, broker_pids, samples
        self.ticks: list[_Tick] = []
        self._threads: dict[str, float] = {}

    def tick(self) -> _Tick:
        pids = process_tree(self.job_pid)  # the CLI, then the JVM it starts
        # task threads end with the job: keep each thread's last (largest) reading
        self._threads = {k: max(v, self._threads.get(k, 0.0)) for k, v in {**self._threads, **threads_cpu_seconds(pids)}.items()}
        tick = _Tick(time.monotonic(), cpu_seconds(pids), cpu_seconds(self.broker_pids), _jit_cpu(self._threads),
                     self.samples.count(), dict(self._threads))
        if self.ticks:  # the processes' figures vanish when they exit: never go back
            last = self.ticks[-1]
            tick = tick._replace(flink_cpu=max(tick.flink_cpu, last.flink_cpu), broker_cpu=max(tick.broker_cpu, last.broker_cpu))
        self.ticks.append(tick)
        return tick


class _SamplesWritten:
    """How many samples the job has written so far (the samples topic's end offsets):
    a fine-grained progress signal (Flink's REST metrics refresh every few seconds)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from kafka import TopicPartition

        self._consumer = make_consumer(bootstrap, group_id=None)
        self._topic, self._tp = topic, TopicPartition
        self._parts: list = []

    def count(self) -> int:
        if not self._parts:  # the job creates the topic
            if self._topic not in self._consumer.topics():  # topics() refreshes the metadata
                return 0
            self._parts = [self._tp(self._topic, p) for p in sorted(self._consumer.partitions_for_topic(self._topic) or [])]
        return sum(self._consumer.end_offsets(self._parts).values())

    def close(self) -> None:
        self._consumer.close()


def _steady(ticks: list[_Tick], total_samples: int, events: int) -> dict:
    """The window between 25% and 90% of the samples written: after the JVM's warm-up (most
    of its JIT compilation) and before the end of input's final flush."""
    inside = [t for t in ticks if 0.25 * total_samples <= t.samples <= 0.9 * total_samples]
    if len(inside) < 2 or inside[-1].samples == inside[0].samples:
        return {}
    return _window(inside[0], inside[-1], total_samples, events)


def _thread_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    deltas = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(deltas.items(), key=lambda kv: -kv[1])[:14] if v >= 0.05}


def _jit_cpu(threads: dict[str, float]) -> float:
    """CPU of the JVM's JIT compiler threads: a one-off cost that a run of a few hundred
    thousand events cannot amortise (a long-running job pays it once)."""
    return sum(cpu for name, cpu in threads.items() if name.startswith(("C1 Compiler", "C2 Compiler")))


def python_baseline(args, topic: str) -> dict:
    """kafka-python consumer + the exact reference builder over the same events."""
    from kafka import TopicPartition

    started = time.monotonic()
    consumer = make_consumer(args.bootstrap, group_id=None, auto_offset_reset="earliest", max_poll_records=5000)
    parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(parts)
    end = consumer.end_offsets(parts)
    builder = SampleBuilder(FeatureSpec())
    n = 0
    deadline = time.monotonic() + 600
    while any(consumer.position(tp) < end[tp] for tp in parts):  # to the end offsets, however slow the first fetch
        if time.monotonic() > deadline:
            raise SystemExit(f"the baseline consumer could not read {topic} to its end within 600 s")
        for records in consumer.poll(500).values():
            for record in records:
                builder.add(record.value, record.timestamp)
            n += len(records)
    table = builder.build()
    elapsed = time.monotonic() - started
    consumer.close()
    return {"events": n, "samples": table.num_rows, "elapsed_s": round(elapsed, 2), "events_per_s": round(n / elapsed)}


def live_latency(args, tmp: Path) -> dict:
    name = f"{args.name}-live"
    env = _env(args, name, tmp, args.backend)
    job = _cli(env, "pipeline", "submit", "--fresh", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 120)
    seen: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def follow() -> None:
        consumer = make_consumer(args.bootstrap, f"{name}.samples", group_id=None, auto_offset_reset="earliest",
                                 isolation_level="read_committed")
        while not stop.is_set():
            for records in consumer.poll(200).values():
                now_ms = time.time() * 1000
                for r in records:
                    sample = orjson.loads(r.value)
                    if sample["label"] == 1:
                        seen.append((now_ms, sample["ts"], sample["click_ts"]))
        consumer.close()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    gen = _cli(env, "generate", "--duration", str(args.live_seconds), "--rate", str(args.live_rate), "--no-truth",
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gen.wait()
    time.sleep(args.drain_seconds)
    stop.set()
    follower.join(10)
    os.killpg(job.pid, 15)
    job.wait(60)
    warm = [s for s in seen if s[1] > seen[0][1] + 5000] if seen else []  # skip the first seconds (job warm-up)
    from_imp = np.array([now - ts for now, ts, _ in warm])
    from_click = np.array([now - click for now, _, click in warm])
    if not len(warm):
        return {"rate": args.live_rate, "positives": 0}
    return {"rate": args.live_rate, "seconds": args.live_seconds, "positives": len(warm), "backend": args.backend,
            "impression_to_sample_ms": {"p50": float(np.percentile(from_imp, 50)), "p99": float(np.percentile(from_imp, 99))},
            "click_to_sample_ms": {"p50": float(np.percentile(from_click, 50)), "p99": float(np.percentile(from_click, 99))}}


def flink_sustained(args, tmp: Path) -> dict:
    """``--rounds`` backlogs of ``--seconds`` x ``--rate`` events through one long-running
    job, the way a job that never stops sees its input: the JIT compiler's warm-up is paid
    in the first rounds and amortised over the rest, as in production. A round is written in
    one transaction (``generate --atomic``; the job reads read_committed, so it waits),
    then processed.
    Each round's window runs from its first sample to its last, with every CPU-second of
    the Flink JVM in it (JIT, GC, checkpoints every ``flink.checkpoint_interval_s``
    included); the job's idle time between rounds (writing the next one) is not counted."""
    name = f"{args.name}-sustained"
    # No source reader may count as idle in the pauses between rounds: when a round arrives,
    # the first reader to resume would move the watermark alone, before the others have read
    # their partitions, and their events would go to the DLQ as late (docs/pipeline.md, late
    # data). A job that sees silences and then backlogs needs the same setting.
    env = {**_env(args, name, tmp, args.backend), "STREAMREC_FLINK__IDLE_TIMEOUT_S": "3600"}
    events_topic, samples_topic = env["STREAMREC_TOPICS__EVENTS"], env["STREAMREC_TOPICS__SAMPLES"]
    job = _cli(env, "pipeline", "submit", "--fresh", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    samples = _SamplesWritten(args.bootstrap, samples_topic)
    probe = _Probe(job.pid, args.broker_pids, samples)
    stop = threading.Event()

    def sample_forever() -> None:
        while not stop.is_set():
            probe.tick()
            time.sleep(0.25)

    # event time starts in the past, so that no round runs ahead of the job's far-future check
    start_ms = int(time.time() * 1000) - int(args.rounds * args.seconds * 1000) - 60_000
    rounds: list[dict] = []
    windows: list[tuple[_Tick, _Tick]] = []
    try:
        FlinkRest(f"127.0.0.1:{env['STREAMREC_FLINK__REST_PORT']}").wait_running(name, 120)
        sampler = threading.Thread(target=sample_forever, daemon=True)
        sampler.start()
        for r in range(args.rounds):
            before = samples.count()  # the job sees nothing of the round until its transaction commits
            gen = subprocess.run([sys.executable, "-m", "streamrec.cli", "generate", "--seed", str(100 + r), "--start-ms",
                                  str(start_ms), "--duration", str(args.seconds), "--rate", str(args.rate), "--fast",
                                  "--atomic", "--no-truth", "--json"], cwd=REPO, env=env, capture_output=True, text=True)
            if gen.returncode != 0:
                raise SystemExit(gen.stderr)
            summary = orjson.loads(gen.stdout)
            start_ms = summary["end_ms"] + 1
            result, window = _sustained_round(args, probe, r, before, summary["events"], summary["impressions"], job,
                                              env["STREAMREC_FLINK__GROUP_ID"], events_topic)
            rounds.append(result)
            windows.append(window)
            rounds[-1]["dlq"] = dlq = _dlq_reasons(args.bootstrap, env["STREAMREC_TOPICS__DLQ"])
            print(f"round {r + 1}/{args.rounds}: {rounds[-1]['events_per_s']:,} events/s, "
                  f"{rounds[-1]['events_per_flink_cpu_s']:,} per Flink CPU-second "
                  f"(JIT {rounds[-1]['jit_cpu_s']} of {rounds[-1]['flink_cpu_s']} CPU-s), DLQ {dlq}", flush=True)
            if dlq.get(LATE_EVENT):
                print(f"warning: round {r + 1} sent {dlq[LATE_EVENT]:,} events to the DLQ as late: its figures do not "
                      "describe the whole round", flush=True)
    finally:
        stop.set()
        if job.poll() is None:
            os.killpg(job.pid, 15)
            job.wait(60)
        samples.close()
    later = rounds[args.warmup_rounds:]
    events, cpu, jit = (sum(r[k] for r in later) for k in ("events", "flink_cpu_s", "jit_cpu_s"))
    seconds = sum(r["seconds"] for r in later)
    # the conservative figure: every CPU-second of the JVM from the first counted round's
    # start to the last one's end, the pauses between rounds (idle polls, checkpoints) included
    first, last = windows[args.warmup_rounds][0], windows[-1][1]
    span_cpu = last.flink_cpu - first.flink_cpu
    return {"backend": args.backend, "rounds": rounds,
            "after_warmup": {"rounds": len(later), "events": events, "seconds": round(seconds, 2),
                             "events_per_s": round(events / seconds), "flink_cpu_s": round(cpu, 2),
                             "jit_cpu_s": round(jit, 2), "events_per_flink_cpu_s": round(events / cpu),
                             "span_s": round(last.t - first.t, 2), "span_flink_cpu_s": round(span_cpu, 2),
                             "events_per_flink_cpu_s_with_pauses": round(events / span_cpu),
                             "flink_threads_cpu_s": _thread_deltas(first.threads, last.threads)}}


def _dlq_reasons(bootstrap: str, topic: str) -> dict[str, int]:
    """What the DLQ holds, by reason (the generator's clicks later than the attribution
    window are orphans by design; late events would mean lost input)."""
    from collections import Counter

    consumer = make_consumer(bootstrap, topic, group_id=None, auto_offset_reset="earliest", consumer_timeout_ms=2000)
    try:
        return dict(Counter(dict(r.headers).get("reason", b"?").decode().split(":")[0] for r in consumer))
    finally:
        consumer.close()


def _sustained_round(args, probe: "_Probe", r: int, before: int, events: int, impressions: int, job, group: str,
                     events_topic: str) -> tuple[dict, tuple["_Tick", "_Tick"]]:
    """Wait until the job has read the whole round (its consumer group's offsets, committed
    at each checkpoint, reach the topic's end) and its sample count has stood still for 2 s;
    the window runs from the first new sample to the last. The round's last impressions'
    negatives wait for the next round's watermark (the attribution window): they count in
    the next round, as the previous round's did in this one."""
    from kafka import TopicPartition

    admin = make_admin(args.bootstrap)
    offsets = make_consumer(args.bootstrap, group_id=None)
    try:
        parts = [TopicPartition(events_topic, p) for p in sorted(offsets.partitions_for_topic(events_topic) or [])]
        end = offsets.end_offsets(parts)
        deadline = time.monotonic() + 600
        while True:
            if job.poll() is not None:
                raise SystemExit(f"the pipeline job ended (exit {job.returncode}) during round {r + 1}")
            if time.monotonic() > deadline:
                raise SystemExit(f"round {r + 1}: the job wrote {probe.ticks[-1].samples - before} of ~{impressions} "
                                 "samples and had not read all its events after 600 s")
            time.sleep(0.5)
            mine = [t for t in probe.ticks if t.samples > before]
            committed = admin.list_group_offsets({group: parts}).get(group, {})
            # the last offset of each partition is the round's transaction marker, which Flink's
            # committed offset (its last record's + 1) stops short of
            read_all = all(committed.get(tp) is not None and committed[tp].offset >= end[tp] - 1 for tp in parts)
            if mine and read_all and probe.ticks[-1].t - _last_change(mine).t >= 2.0:
                break
    finally:
        admin.close()
        offsets.close()
    start, end = max((t for t in probe.ticks if t.samples <= before), key=lambda t: t.t), _last_change(mine)
    progress = [(round(t.t - start.t, 2), round(t.flink_cpu - start.flink_cpu, 2), t.samples - before)
                for t in probe.ticks if start.t <= t.t <= end.t]
    return {"round": r + 1, **_window(start, end, impressions, events), "progress": progress}, (start, end)


def _last_change(ticks: list["_Tick"]) -> "_Tick":
    """The first reading with the final sample count."""
    return next(t for t in ticks if t.samples == ticks[-1].samples)


def _medians(runs: list[dict]) -> dict:
    """Per backend, the median of each headline figure over its runs (this box is noisy)."""
    out = {}
    for backend in dict.fromkeys(r["backend"] for r in runs):
        mine = [r for r in runs if r["backend"] == backend]
        med = lambda values: int(np.median([v or 0 for v in values]))  # noqa: E731
        out[backend] = {"runs": len(mine), "events_per_s": med(r["events_per_s"] for r in mine),
                        "events_per_flink_cpu_s": med(r["events_per_flink_cpu_s"] for r in mine),
                        "steady_events_per_s": med(r["steady"].get("events_per_s") for r in mine),
                        "steady_events_per_flink_cpu_s": med(r["steady"].get("events_per_flink_cpu_s") for r in mine)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--seconds", type=float, default=60, help="simulated seconds of backlog traffic")
    parser.add_argument("--rate", type=float, default=2000, help="events/s of the backlog traffic")
    parser.add_argument("--backends", default="rocksdb,rocksdb-nocache,hashmap",
                        help=f"comma-separated, each one of {', '.join(BACKENDS)} (rocksdb-nocache: without the stages' state cache)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the backends round-robin this many times (medians reported); 0: no backlog runs")
    parser.add_argument("--rounds", type=int, default=4,
                        help="sustained phase: this many backlogs through one long-running job (--backend); 0: skip")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="sustained phase: rounds left out of its totals (JIT warm-up)")
    parser.add_argument("--backend", default="rocksdb", help="state backend of the sustained and live phases")
    parser.add_argument("--live-rate", type=float, default=1000)
    parser.add_argument("--live-seconds", type=float, default=40, help="0: skip the live-latency phase")
    parser.add_argument("--drain-seconds", type=float, default=15)
    parser.add_argument("--out", default="var/bench", help="directory of the JSON result (default: ./var/bench, under the current directory)")
    args = parser.parse_args()
    if args.rounds and args.warmup_rounds >= args.rounds:
        parser.error(f"--warmup-rounds ({args.warmup_rounds}) must be fewer than --rounds ({args.rounds})")
    tmp = REPO / "var" / "bench-pipeline"
    name = args.name = f"bench-{uuid.uuid4().hex[:6]}"
    broker = _embedded_broker()
    args.broker_pids = broker.status().pids if broker else []
    env = _env(args, name, tmp, "rocksdb")
    gen = subprocess.run([sys.executable, "-m", "streamrec.cli", "generate", "--duration", str(args.seconds), "--rate",
                          str(args.rate), "--fast", "--no-truth", "--json"], cwd=REPO, env=env, capture_output=True, text=True)
    if gen.returncode != 0:
        raise SystemExit(gen.stderr)
    events = orjson.loads(gen.stdout)["events"]
    cores = os.cpu_count() or 1
    try:
        result = {"machine": f"{cores} cores", "events": events, "flink": [], "python": python_baseline(args, f"{name}.events")}
        print(f"python baseline: {result['python']['events_per_s']:,} events/s", flush=True)
        for i, backend in enumerate(b for _ in range(args.repeat) for b in args.backends.split(",")):
            run = flink_backlog(args, env, backend, tmp, events, i)
            run["events_per_s_per_core"] = round(run["events_per_s"] / cores)
            run["vs_python"] = round(run["events_per_s"] / result["python"]["events_per_s"], 2)
            result["flink"].append(run)
            steady = run["steady"]
            print(f"flink {backend}: {run['events_per_s']:,} events/s ({run['events_per_s_per_core']:,}/core, "
                  f"{run['vs_python']}x python), {run['events_per_flink_cpu_s'] or 0:,} events per CPU-second of the "
                  f"Flink process, {run['events_per_flink_cpu_s_without_jit'] or 0:,} without its JIT compiler's "
                  f"{run['jit_cpu_s']} CPU-s (broker: {run['broker_cpu_s']} CPU-s), start-up {run['startup_s']} s; "
                  f"steady ({steady.get('seconds')} s from 25% to 90% of the samples): {steady.get('events_per_s') or 0:,} "
                  f"events/s, {steady.get('events_per_flink_cpu_s') or 0:,} per Flink CPU-second "
                  f"(JIT {steady.get('jit_cpu_s')} of {steady.get('flink_cpu_s')} CPU-s)", flush=True)
        result["median"] = _medians(result["flink"]) if result["flink"] else {}
        for backend, m in result["median"].items():
            print(f"median of {m['runs']} {backend} runs: {m['events_per_s']:,} events/s, {m['events_per_flink_cpu_s']:,} "
                  f"per Flink CPU-second; steady {m['steady_events_per_s']:,} events/s, "
                  f"{m['steady_events_per_flink_cpu_s']:,} per Flink CPU-second", flush=True)
        if args.rounds > 0:
            result["sustained"] = sustained = flink_sustained(args, tmp)
            total = sustained["after_warmup"]
            print(f"sustained {args.backend}, {total['rounds']} rounds after {args.warmup_rounds} warm-up rounds: "
                  f"{total['events']:,} events, {total['events_per_s']:,} events/s, {total['events_per_flink_cpu_s']:,} "
                  f"per Flink CPU-second (JIT {total['jit_cpu_s']} of {total['flink_cpu_s']} CPU-s); "
                  f"{total['events_per_flink_cpu_s_with_pauses']:,} per Flink CPU-second counting the pauses between "
                  f"rounds ({total['span_flink_cpu_s']} CPU-s in {total['span_s']} s)", flush=True)
        result["live"] = live_latency(args, tmp) if args.live_seconds > 0 else {}
    finally:
        # the bench's topics are its own: none is left behind
        deleted = delete_topics(args.bootstrap, [t for t in list_topics(args.bootstrap) if t.startswith(name)])
        print(f"deleted the bench's {len(deleted)} topics", flush=True)
    print(f"live at {args.live_rate:g} events/s: {result['live']}", flush=True)
    write_result(args.out, "pipeline", result)


if __name__ == "__main__":
    main()
