"""Child processes: the environment of one that runs ``python -m streamrec...`` (front-ends,
the prediction log's sender: from a source checkout, its package must be importable there
too), and where the JVM tools the project starts (java, javac, mvn) are found."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def python_env() -> dict[str, str]:
    """This process's environment, with a source checkout's root first on PYTHONPATH (an
    installed package needs nothing)."""
    env = dict(os.environ)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)
    return env


def find_tool(name: str) -> str | None:
    """``name`` from PATH, else from ``$JAVA_HOME/bin`` (the JDK's tools); None when neither has it."""
    found = shutil.which(name)
    if not found and os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / name
        found = str(candidate) if candidate.is_file() else None
    return found


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone; a zombie child of ours is reaped)."""
    if pid <= 0:
        return False  # 0 and -1 would ask about a process group, not a process
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to the signal check
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: os.kill's answer stands
