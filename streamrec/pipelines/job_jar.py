"""Builds the streaming job (``java/`` beside this module: its sources and pom.xml) into one
jar with Maven, cached in the user's cache directory.

The job runs in the JVM because per-record Python functions in PyFlink are far slower
(docs/pipeline.md, bench/RESULTS.md). Flink is provided by the PyFlink runtime; the jar holds
the job, the Kafka connector and kafka-clients (java/pom.xml says which and why). The jar is
named by a hash of the sources and the pom, so a changed source gives a new jar and an
unchanged one is never rebuilt. Maven runs on a copy in a temporary directory inside the
cache, so neither an installed package nor a checkout gets a ``target/``, and the finished
jar is renamed into place (readers see it whole or not at all).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from streamrec.plumbing.processes import find_tool

SOURCE_DIR = Path(__file__).parent / "java"
SETUP_HINT = "run `streamrec setup flink-job` (`make setup` does)"
# Jars of other source versions kept beside the current one: a job being submitted from an
# older checkout (or a test run while the sources change) may still be about to load its jar.
KEEP_OTHER_JARS = 2


class JobJarError(RuntimeError):
    """The job's jar is missing or cannot be built."""


def _inputs() -> list[Path]:
    """Every file the build reads: the pom and the Java sources."""
    return [SOURCE_DIR / "pom.xml", *sorted(SOURCE_DIR.rglob("*.java"))]


def source_hash() -> str:
    h = hashlib.sha256()
    for path in _inputs():
        h.update(path.relative_to(SOURCE_DIR).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def job_jar_path(jars_dir: Path) -> Path:
    """Where the jar of the current sources is (or will be) in ``jars_dir``."""
    return Path(jars_dir) / f"streamrec-job-{source_hash()}.jar"


def verify_job_jar(jars_dir: Path) -> Path:
    """The jar of the current sources; JobJarError unless it is there and holds the job."""
    jar = job_jar_path(jars_dir)
    if not jar.is_file():
        raise JobJarError(f"the Flink job's jar {jar} is missing: {SETUP_HINT}")
    try:
        with zipfile.ZipFile(jar) as zf:
            zf.getinfo("streamrec/flink/SampleJob.class")
    except (zipfile.BadZipFile, KeyError) as exc:
        raise JobJarError(f"{jar} is not the job's jar ({exc}): delete it and {SETUP_HINT}") from exc
    return jar


def _tool(name: str) -> str:
    """``name`` (mvn, javac) from PATH or JAVA_HOME/bin."""
    found = find_tool(name)
    if not found:
        raise JobJarError(f"`{name}` not found: the Flink job is built with Maven 3 and a JDK 17+; install them "
                          "(Debian: apt install maven openjdk-17-jdk-headless) or put them on PATH / set JAVA_HOME")
    return found


def ensure_job_jar(jars_dir: Path) -> Path:
    """The jar of the current sources in ``jars_dir``, built with Maven if missing; idempotent."""
    jars_dir = Path(jars_dir)
    jar = job_jar_path(jars_dir)
    if jar.is_file():
        return jar
    mvn = _tool("mvn")
    _tool("javac")  # Maven on a JRE fails late, with a message that does not say what to install
    jars_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=jars_dir, prefix=".build-") as tmp:
        project = Path(tmp) / "java"
        for path in _inputs():
            copy = project / path.relative_to(SOURCE_DIR)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(project / "pom.xml"), "package"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise JobJarError(f"building the Flink job with Maven failed (exit {result.returncode}):\n"
                              f"{(result.stdout + result.stderr).strip()[-3000:]}")
        os.replace(project / "target" / "streamrec-job.jar", jar)  # same file system: atomic
    _prune_old_jars(jars_dir, keep=jar)
    return jar


def _prune_old_jars(jars_dir: Path, keep: Path) -> None:
    """Delete all but the newest KEEP_OTHER_JARS jars of other source versions."""
    others = []
    for path in jars_dir.glob("streamrec-job-*.jar"):
        if path == keep:
            continue
        try:
            others.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # pruned by a concurrent call
            continue
    for _, old in sorted(others, reverse=True)[KEEP_OTHER_JARS:]:
        old.unlink(missing_ok=True)
