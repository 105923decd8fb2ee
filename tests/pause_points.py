"""Pause points for kill tests: a SIGKILL that lands inside a named window, every time.

A kill timed by ``time.sleep`` can land between two writes and then tests nothing while
still passing. Here the test starts the real process (a ``streamrec`` command, or a script)
with :func:`install` run first in that child; production code has no hook. ``install``
wraps ``StoreFiles.write``: once the test *arms* a point (:func:`arm` writes its name into
the arm file), the child's next file write at that point stops there, writes a marker
(JSON: point, path, bytes) and sleeps until the test kills it (:func:`wait_paused` returns
the marker). The marker's path lets the test check afterwards that the partial state of
the window is on disk, so a kill that missed its window fails the test. A test that wants
the process to go on instead (after freezing it, say) calls :func:`release`: the write then
completes and the process carries on from inside its window.

Points, all inside ``VersionWriter.publish`` / ``commit`` on a store that renames (a local path):

- ``sparse``:   half of a staged sparse file is written (a torn file in ``versions/.tmp-*``)
- ``manifest``: the staged version is complete, manifest included, not yet renamed into place
- ``latest``:   the version is in place, LATEST's temp file is written, LATEST not yet moved
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ARM_ENV = "STREAMREC_TEST_PAUSE_ARM"
POINTS = ("sparse", "manifest", "latest")
TESTS_DIR = str(Path(__file__).resolve().parent)


def _point(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1]
    if "/versions/.tmp-" in path:
        if name == "manifest.json":
            return "manifest"
        if "/sparse/" in path:
            return "sparse"
    if name.startswith(".LATEST.tmp-"):
        return "latest"
    return None


def install() -> None:
    """In the child: pause at the armed point (the arm file is named by $STREAMREC_TEST_PAUSE_ARM)."""
    from streamrec.modelstore.files import StoreFiles

    arm_file = Path(os.environ[ARM_ENV])
    write = StoreFiles.write

    def pausing_write(self, path: str, data: bytes) -> None:
        point = _point(path)
        try:
            armed = point is not None and arm_file.read_text().strip() == point
        except FileNotFoundError:
            armed = False
        if not armed:
            return write(self, path, data)
        arm_file.unlink()  # one pause per arm
        write(self, path, data[: len(data) // 2] if point == "sparse" else data)
        marker = _marker(arm_file)
        marker.with_suffix(".tmp").write_text(json.dumps({"point": point, "path": path, "bytes": len(data)}))
        marker.with_suffix(".tmp").rename(marker)
        released, deadline = _released(arm_file), time.monotonic() + 3600
        while not released.exists() and time.monotonic() < deadline:  # until the test's SIGKILL or release()
            time.sleep(0.02)
        released.unlink(missing_ok=True)
        if point == "sparse":
            write(self, path, data)

    StoreFiles.write = pausing_write


def _released(arm_file: Path) -> Path:
    return arm_file.with_name(arm_file.name + ".released")


def _marker(arm_file: Path) -> Path:
    return arm_file.with_name(arm_file.name + ".paused")


def arm(arm_file: Path, point: str) -> None:
    assert point in POINTS, point
    _marker(arm_file).unlink(missing_ok=True)
    tmp = arm_file.with_name(arm_file.name + ".tmp")
    tmp.write_text(point)
    tmp.rename(arm_file)


def wait_paused(arm_file: Path, proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    """The marker of the armed point, once the child sits inside it (fails if it never gets there)."""
    marker, deadline = _marker(arm_file), time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, f"the process ended before reaching the armed pause point (exit {proc.returncode})"
        assert time.monotonic() < deadline, f"the process did not reach the pause point {arm_file.read_text()!r}"
        time.sleep(0.02)
    return json.loads(marker.read_text())


def release(arm_file: Path) -> None:
    """Let the child paused at the armed point finish that write and go on."""
    _released(arm_file).write_text("go")


def child_env(arm_file: Path, env: dict | None = None) -> dict:
    """The child's environment: this module importable, the arm file named."""
    env = {**os.environ, **(env or {}), ARM_ENV: str(arm_file)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, os.getcwd(), env.get("PYTHONPATH")) if p)
    return env


def streamrec_argv(*args: str) -> list[str]:
    """``python -m streamrec.cli ARGS`` with the pause points installed first."""
    boot = "import runpy, sys, pause_points; pause_points.install(); sys.argv[0] = 'streamrec'; " \
           "runpy.run_module('streamrec.cli', run_name='__main__')"
    return [sys.executable, "-c", boot, *args]
