"""The package as a user installs it: a wheel built from this tree, installed into a fresh
virtualenv, run from an empty directory. The broker and `streamrec demo` (the README's main
job, with the Flink job it submits) must work from there, write only under that directory
(and the user cache of Kafka's jars and the Flink job's), never into the installed package, and do what
the demo claims (demo_claims.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from demo_claims import assert_demo_claims

pytestmark = [pytest.mark.slow, pytest.mark.serial]

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_wheel(work: Path) -> Path:
    """A wheel of this tree, built from a copy (the checkout gets no build/ or egg-info)."""
    src = work / "src"
    shutil.copytree(REPO / "streamrec", src / "streamrec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = work / "dist"
    # this environment's setuptools when it is new enough for pyproject.toml (nothing to download), else pip's isolated build
    import setuptools

    isolation = ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 68 else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("streamrec-*.whl")
    return wheel


def _fresh_venv(work: Path, wheel: Path) -> Path:
    """A new virtualenv holding only the wheel; its dependencies (torch, pyflink, ...) are
    this interpreter's, reached through a .pth path entry, so nothing is downloaded."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "outer-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    return venv


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def test_the_installed_wheel_runs_the_demo_from_an_empty_directory(tmp_path):
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    streamrec = str(venv / "bin" / "streamrec")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_") and k != "PYTHONPATH"}
    env["STREAMREC_KAFKA__EMBEDDED_PORT"] = str(_free_port())

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([streamrec, *args], cwd=home, env=env, capture_output=True, text=True, timeout=timeout)

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import streamrec; print(streamrec.__file__)"],
                           cwd=home, env=env, capture_output=True, text=True, check=True).stdout.strip()
    package = Path(where).parent
    assert package.is_relative_to(venv), f"streamrec imported from {where}, not from the installed wheel"
    assert (package / "pipelines" / "java").is_dir() and (package / "plumbing" / "defaults.toml").is_file()
    installed = _files(package)

    assert (package / "plumbing" / "bus" / "kafka_server" / "pom.xml").is_file()
    setup = run("setup", "all")  # the user cache, already filled by `make setup`: verified, nothing fetched
    assert setup.returncode == 0, setup.stdout + setup.stderr
    up = run("kafka", "up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        demo = run("demo", "--duration", "60", "--publish-interval", "8", "--drain", "20", "--warmup-samples", "1000",
                   timeout=600)
    finally:
        down = run("kafka", "down")
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert down.returncode == 0, down.stdout + down.stderr

    summary = demo.stdout[demo.stdout.index("summary"):]
    scored = int(summary.split("scored at the serving node")[1].split()[0].replace(",", ""))
    assert scored > 1000, summary
    assert "freshness (click event time -> servable)" in summary, summary
    assert (home / "var" / "kafka").is_dir() and list((home / "var" / "reports").glob("*/report.html"))
    assert list((home / "var" / "demo").glob("*/models/ctr/versions/*/manifest.json"))
    assert _files(package) == installed, "the run wrote into the installed package"

    (run_dir,) = list((home / "var" / "reports").iterdir())
    assert_demo_claims(run_dir, demo.stdout)
    (run_dir / "report.html").unlink()  # the report re-renders from the run's data alone
    again = run("report", str(run_dir))
    assert again.returncode == 0 and (run_dir / "report.html").is_file(), again.stderr
    assert _files(package) == installed
