"""A disk that fills up under a running trainer (issue 36, case 9): the run ends with exit
code 3 and one line that names the file and "no space left on device", no traceback, and
no JSON-lines file the trainer wrote ends with half a line.

The full disk is a real one: a small tmpfs mounted for the test, so the writes fail with
ENOSPC where they would in production. Mounting needs root; elsewhere these tests skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from streamrec.trainer.checkpoint import Checkpointer
from streamrec.trainer.local_files import JsonLinesFile, WriteFailed

PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at ``tmp_path / "disk"``, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave_bytes: int) -> None:
    """Take all of ``disk`` but about ``leave_bytes``."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave_bytes))


def train_on(sample_run: Path, work: Path, store: Path, progress_s: float = 0.05, checkpoint_s: float = 3600) -> subprocess.CompletedProcess:
    """`streamrec train` from files, reading them again and again (it never ends by itself),
    with a row in eval.jsonl every ``progress_s`` and a checkpoint every ``checkpoint_s``."""
    return run_cli("train", "--samples", str(sample_run), "--loop", "--max-seconds", "60", "--work-dir", str(work),
                   "--model-store", str(store), "--publish-interval", "0.3", "--checkpoint-interval", str(checkpoint_s),
                   "--batch-size", "256", "--device", "cpu", "--no-announce", "--no-frozen",
                   env={"STREAMREC_TRAINER__PROGRESS_INTERVAL_S": str(progress_s)}, timeout=120)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The run ended the documented way: exit 3, one error line, no traceback; returns the line."""
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("streamrec: error: ")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr[-3000:]
    return errors[0]


def assert_whole_lines(root: Path) -> None:
    """Every .jsonl under ``root`` ends with a complete line, and each line parses."""
    logs = list(root.rglob("*.jsonl"))
    assert logs
    for path in logs:
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path} ends with half a line: {data[-200:]!r}"
        for line in data.splitlines():
            json.loads(line)


@pytest.mark.slow
def test_a_full_work_dir_ends_the_run_with_exit_3_and_no_torn_eval_log(sample_run, small_disk, tmp_path):
    """The work dir fills up while eval.jsonl grows; the model store is on another disk."""
    work = small_disk / "work"
    fill(small_disk, leave_bytes=4 * PAGE)
    result = train_on(sample_run, work, tmp_path / "models")
    line = error_line(result)
    assert re.search(rf"cannot write {re.escape(str(work))}/ctr/eval\.jsonl: no space left on device", line), line
    assert re.search(r"the last published version is (\d+|none), the last checkpoint none", line), line
    assert_whole_lines(work)


@pytest.mark.slow
def test_a_full_disk_under_work_dir_and_model_store_ends_the_run_with_exit_3(sample_run, small_disk):
    """Work dir and model store share the disk (as in the issue): versions fail to publish,
    logs fail to grow; whichever gives up first, the run ends the same way."""
    fill(small_disk, leave_bytes=64 * PAGE)
    result = train_on(sample_run, small_disk / "work", small_disk / "models")
    line = error_line(result)
    assert str(small_disk) in line and "no space left on device" in line.lower(), line
    assert "the last published version is" in line and "the last checkpoint" in line, line
    assert_whole_lines(small_disk / "work")


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_in_charge(sample_run, small_disk, tmp_path):
    """Checkpoints every half second grow until one does not fit: what it wrote is removed,
    and the error names the checkpoint LATEST still names, the one a restart resumes from."""
    checkpoints = small_disk / "work" / "ctr" / "checkpoints"
    result = train_on(sample_run, small_disk / "work", tmp_path / "models", progress_s=3600, checkpoint_s=0.5)
    line = error_line(result)
    assert re.search(rf"cannot write {re.escape(str(checkpoints))}/(ckpt-\d+|LATEST): no space left on device", line), line
    complete = [p.name for p in checkpoints.glob("ckpt-*") if (p / "state.json").is_file()]
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(complete + ["LATEST"] * bool(complete))  # no temp files left
    latest = Checkpointer(checkpoints).latest()
    assert (latest.name if latest else None) == max(complete, default=None)  # LATEST names the newest: a restart's
    assert f"the last checkpoint {latest.name if latest else 'none'};" in line, line


def test_a_json_lines_write_that_fails_leaves_the_file_as_it_was(small_disk):
    fill(small_disk, leave_bytes=2 * PAGE)
    log = JsonLinesFile(small_disk / "log.jsonl")
    row = json.dumps({"pad": "x" * 1000}).encode() + b"\n"
    with pytest.raises(WriteFailed, match=rf"cannot write {re.escape(str(small_disk))}/log\.jsonl: no space left on device"):
        for _ in range(100):
            log.append(row)
    log.close()
    data = (small_disk / "log.jsonl").read_bytes()
    assert data and len(data) % len(row) == 0 and all(json.loads(line) for line in data.splitlines())


def test_a_torn_last_line_is_cut_when_the_log_is_opened_again(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')  # a process killed mid-write
    log = JsonLinesFile(path)
    log.append(b'{"d": 4}\n')
    log.close()
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n{"d": 4}\n'


def test_the_rejected_log_rotates_and_keeps_whole_lines_on_a_full_disk(small_disk):
    from streamrec.trainer.rejected import RejectedLog

    kept = RejectedLog(small_disk / "rejected" / "rank-00000.jsonl", max_bytes=1500)
    for offset in range(20):  # ~200 bytes each: the file turns over to .1 more than once
        kept.add("t", 0, offset, "malformed_json", b"{not json" + b"x" * 100)
    kept.flush()
    rows = [json.loads(line) for name in ("rank-00000.jsonl.1", "rank-00000.jsonl")
            for line in (small_disk / "rejected" / name).read_bytes().splitlines()]
    assert [r["offset"] for r in rows] == list(range(rows[0]["offset"], 20)) and rows[0]["offset"] > 0
    assert all(r["value"] == "{not json" + "x" * 100 for r in rows)
    kept.close()
    other = RejectedLog(small_disk / "rejected" / "rank-00001.jsonl", max_bytes=1 << 20)
    other.add("t", 1, 0, "malformed_json", b"{")
    other.flush()
    before = (small_disk / "rejected" / "rank-00001.jsonl").read_bytes()
    fill(small_disk, leave_bytes=PAGE)
    for offset in range(1, 21):  # more than the page left: the write stops part way
        other.add("t", 1, offset, "malformed_json", b"y" * 2000)
    with pytest.raises(WriteFailed, match=r"rank-00001\.jsonl: no space left on device"):
        other.close()
    assert (small_disk / "rejected" / "rank-00001.jsonl").read_bytes() == before
