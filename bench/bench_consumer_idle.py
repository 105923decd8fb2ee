"""CPU of an idle Kafka consumer: kafka-python's blocking poll vs ``poll_records``.

An idle consumer (nothing to read) should cost next to nothing. Against the embedded
broker, kafka-python 3's blocking ``poll(timeout_ms)`` re-sends a fetch as soon as one
comes back empty and the broker answers empty fetches at once, so the loop spins.
Baseline, same run, same topic: the plain ``consumer.poll(timeout_ms=500)`` loop a
long-lived consumer would run; vs ``streamrec.plumbing.bus.clients.poll_records`` (non-blocking
polls, 50 ms sleeps while nothing is buffered). Reports process CPU (%) of each loop,
read_committed and read_uncommitted, and the ratio.

    streamrec kafka up && streamrec bench consumer_idle [--seconds 8]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from output import write_result  # noqa: E402

from streamrec.plumbing.bus.clients import make_consumer, poll_records  # noqa: E402
from streamrec.plumbing.bus.topics import delete_topics, ensure_topics  # noqa: E402


def cpu_percent(consumer, seconds: float, poll) -> tuple[float, int]:
    """Process CPU (% of one core) of ``seconds`` of polling loop, and the records it read."""
    cpu0, wall0, records = time.process_time(), time.monotonic(), 0
    while time.monotonic() - wall0 < seconds:
        records += sum(len(batch) for batch in poll(consumer).values())
    return round(100 * (time.process_time() - cpu0) / (time.monotonic() - wall0), 1), records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measured loop")
    parser.add_argument("--out", default=str(REPO / "bench" / "out"))
    args = parser.parse_args()
    topic = f"bench-idle-{uuid.uuid4().hex[:6]}"
    ensure_topics(args.bootstrap, [topic], partitions=1)
    loops = {"blocking poll(500 ms) (baseline)": lambda c: c.poll(timeout_ms=500),
             "poll_records(500 ms)": lambda c: poll_records(c, 500)}
    result: dict = {"topic_state": "empty", "seconds": args.seconds, "runs": []}
    try:
        for isolation in ("read_committed", "read_uncommitted"):
            consumer = make_consumer(args.bootstrap, topic, group_id=None, isolation_level=isolation)
            try:
                row = {"isolation": isolation}
                for name, poll in loops.items():
                    row[name] = cpu_percent(consumer, args.seconds, poll)[0]
                base, ours = row["blocking poll(500 ms) (baseline)"], row["poll_records(500 ms)"]
                row["cpu_ratio_baseline_over_ours"] = round(base / ours, 1) if ours else None
                result["runs"].append(row)
                print(f"{isolation}: blocking poll {base}% CPU, poll_records {ours}% CPU", flush=True)
            finally:
                consumer.close()
    finally:
        delete_topics(args.bootstrap, [topic])  # the embedded broker's cost grows with what it holds
    write_result(args.out, "consumer-idle", result)


if __name__ == "__main__":
    main()
