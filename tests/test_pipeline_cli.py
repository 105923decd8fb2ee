"""`streamrec pipeline` as a user meets it: `offline`'s progress, and what `submit --detach`,
`cancel` and `status` leave and say (var/flink/ of the working directory: the Flink log,
the pid file, the record of the last job)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

import pytest

from conftest import free_port
from streamrec.demo.resources import process_tree
from streamrec.plumbing.processes import process_alive


def _cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real entry point, run from ``cwd`` (its var/flink/ is the test's own), with no
    FLINK_LOG_DIR of the caller's: where the Flink log goes by default is under test."""
    full_env = {k: v for k, v in os.environ.items() if k != "FLINK_LOG_DIR"}
    return subprocess.run([sys.executable, "-m", "streamrec.cli", *args], cwd=cwd, env={**full_env, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _on_a_terminal(args: list[str], cwd: Path, timeout: float = 300) -> str:
    """What a command writes to stderr when stderr is a terminal (a pseudo-terminal here)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the command ended and closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(30) == 0, out.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


def test_offline_shows_its_progress_on_a_terminal_and_in_a_log(tmp_path):
    """`pipeline offline` is never silent: lines with counts and rates when not on a terminal
    (every --progress-every seconds, and at the end of each phase), tqdm bars on a terminal."""
    run = tmp_path / "run"
    gen = _cli("generate", "--out", str(run), "--duration", "20", "--rate", "2000", "--seed", "5",
               "--start-ms", "1700000000000", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr

    result = _cli("pipeline", "offline", str(run), "--out", str(tmp_path / "a"), "--progress-every", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "samples (" in result.stdout and (tmp_path / "a" / "samples.parquet").is_file()
    lines = result.stderr.splitlines()
    reading = [ln for ln in lines if ln.startswith("reading events: ") and " of " in ln and "events/s" in ln]
    building = [ln for ln in lines if ln.startswith("building samples: ") and " of " in ln and "samples/s" in ln]
    assert len(reading) >= 3 and len(building) >= 3, result.stderr

    def counts(found: list[str]) -> list[int]:
        return [int(ln.split(": ")[1].split(" of ")[0].replace(",", "")) for ln in found]

    assert counts(reading) == sorted(counts(reading)) and counts(building) == sorted(counts(building))
    assert any(ln.startswith("reading events: ") and " events in " in ln for ln in lines), result.stderr
    assert any(ln.startswith("building samples: ") and " samples in " in ln for ln in lines), result.stderr

    shown = _on_a_terminal(["pipeline", "offline", str(run), "--out", str(tmp_path / "b")], cwd=tmp_path)
    assert "reading events: 100%" in shown and "building samples: 100%" in shown, shown[-2000:]


def test_status_after_a_killed_job_says_unknown_and_drops_the_stale_pid_file(tmp_path):
    """A `submit --detach` process killed with -9 can neither remove its pid file nor record how
    its job ended: `status` removes the pid file of the dead process and says the job's end is
    UNKNOWN, from the record, with no mini-cluster answering."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = tmp_path / "var" / "flink"
    state.mkdir(parents=True)
    (state / "pipeline.pid").write_text(f"{dead.pid}\n")
    (state / "last-job.json").write_text(json.dumps({
        "job_id": "0123456789abcdef0123456789abcdef", "name": "killed", "state": "RUNNING", "duration_s": 12.0,
        "records_in": 100, "records_out": 90, "samples_out": 80, "dlq_out": 5, "features_out": 5, "pid": dead.pid,
        "flink_log": str(state / "log" / "flink.log"), "error": None}))
    env = {"STREAMREC_FLINK__REST_PORT": str(free_port())}
    result = _cli("pipeline", "status", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "0123456789abcdef0123456789abcdef  killed  UNKNOWN" in result.stdout, result.stdout
    assert "80 samples, 5 DLQ, 5 feature records out" in result.stdout and "killed?" in result.stdout
    assert not (state / "pipeline.pid").exists()

    (state / "last-job.json").unlink()  # nothing recorded, nothing answering: the error it always was
    result = _cli("pipeline", "status", cwd=tmp_path, env=env)
    assert result.returncode != 0 and "the embedded mini-cluster is not running" in result.stderr


def _wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_cancelled_job_ends_cleanly_its_pid_file_goes_and_status_says_canceled(broker, tmp_path):
    """`submit --detach`, `status` (records out by sink), `cancel`: the job's process says it
    was cancelled and exits 0, removes its pid file, and `status` afterwards, with the
    mini-cluster gone, says CANCELED. The Flink log is under ./var/flink/log/, not in the
    installed pyflink package."""
    from test_pipeline_job import _env

    name = f"cx-{uuid.uuid4().hex[:8]}"
    env = _env(broker, tmp_path, name)
    gen = _cli("generate", "--duration", "10", "--rate", "500", "--bad-fraction", "0.05", "--fast", cwd=tmp_path, env=env)
    assert gen.returncode == 0, gen.stderr
    submitted = _cli("pipeline", "submit", "--detach", "--fresh", cwd=tmp_path, env=env, timeout=300)
    var = tmp_path / "var" / "flink"
    submit_log = var / "pipeline.log"
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr + (submit_log.read_text() if submit_log.exists() else "")
    pid = int((var / "pipeline.pid").read_text())
    log_dir = (var / "log").resolve()

    def status() -> list[dict]:
        result = _cli("pipeline", "status", "--json", cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        return [j for j in json.loads(result.stdout) if j["name"] == name]

    try:
        assert any(f"-Dlog.file={log_dir}/".encode() in Path(f"/proc/{p}/cmdline").read_bytes() for p in process_tree(pid))
        _wait_for(lambda: all(j["samples_out"] and j["dlq_out"] and j["features_out"] for j in status()), 180,
                  "samples, DLQ records and feature records out")
        (live,) = status()
        assert live["state"] == "RUNNING"
        assert live["records_out"] == live["samples_out"] + live["dlq_out"] + live["features_out"]
        text = _cli("pipeline", "status", cwd=tmp_path, env=env)
        assert " samples, " in text.stdout and " DLQ, " in text.stdout and " feature records out" in text.stdout, text.stdout

        cancelled = _cli("pipeline", "cancel", cwd=tmp_path, env=env)
        assert cancelled.returncode == 0 and f"cancelled {live['job_id']}" in cancelled.stdout, cancelled.stdout + cancelled.stderr
        _wait_for(lambda: not process_alive(pid), 120, "the job's process to end")
        assert not (var / "pipeline.pid").exists(), "the pid file outlived its process"
        output = submit_log.read_text()
        assert f"Flink log {log_dir}/" in output, output
        last = [ln for ln in output.splitlines() if ln.strip()][-1]
        assert "cancelled" in last and "error" not in output.lower(), output[-3000:]
    finally:
        if process_alive(pid):
            os.killpg(pid, signal.SIGKILL)
    after = _cli("pipeline", "status", cwd=tmp_path, env=env)
    assert after.returncode == 0, after.stdout + after.stderr
    assert f"{live['job_id']}  {name}  CANCELED" in after.stdout, after.stdout
    (recorded,) = status()
    assert recorded["state"] == "CANCELED" and recorded["samples_out"] >= live["samples_out"] > 0
    flink_logs = list(log_dir.glob("flink-*.log"))
    assert flink_logs and flink_logs[0].stat().st_size > 0 and recorded["recorded"]["flink_log"] == str(flink_logs[0])
