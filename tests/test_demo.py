"""`streamrec demo`, the README's main job, end to end on a fresh embedded broker."""

import os
import re

import pytest

from tests.conftest import free_port, run_cli


def _noida_processes_for(data_dir) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if str(data_dir).encode() in fh.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_demo_runs_end_to_end_and_cleans_up(tmp_path):
    data = tmp_path / "kafka"
    result = run_cli("demo", "--duration", "6", "--rate", "1500", "--port", str(free_port()), "--data-dir", str(data))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "demo OK: every produced event and truth row came back" in out
    produced = int(re.search(r"read back ([\d,]+) events of ([\d,]+) produced", out).group(2).replace(",", ""))
    assert 6 * 1500 * 0.8 < produced < 6 * 1500 * 1.2
    assert "rejected by the contract: " in out and "malformed_json=" in out
    assert "embedded broker stopped" in out
    assert _noida_processes_for(data) == []
