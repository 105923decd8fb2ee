"""The environment of a child process that runs ``python -m streamrec...`` (front-ends, the
prediction log's sender): from a source checkout, its package must be importable there too."""

from __future__ import annotations

import os
from pathlib import Path


def python_env() -> dict[str, str]:
    """This process's environment, with a source checkout's root first on PYTHONPATH (an
    installed package needs nothing)."""
    env = dict(os.environ)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)
    return env
