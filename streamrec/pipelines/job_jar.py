"""Builds the streaming job (``java/`` beside this module) into a jar with the JDK's javac.

The job runs in the JVM because per-record Python functions in PyFlink are far slower
(docs/pipeline.md, bench/RESULTS.md). There is no Maven here, so the jar is compiled against the Flink jars that
ship inside the PyFlink wheel plus the Kafka connector jars, and cached under the
connector-jar directory, named by a hash of the sources: a changed source gives a new jar,
an unchanged one is never rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from streamrec.pipelines.flink_jars import jar_paths, verify_jars

SOURCE_DIR = Path(__file__).parent / "java"


class JobJarError(RuntimeError):
    pass


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.rglob("*.java"))


def source_hash() -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(path.relative_to(SOURCE_DIR).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _flink_lib() -> Path:
    import pyflink

    return Path(pyflink.__file__).parent / "lib"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if not found and os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / name
        found = str(candidate) if candidate.exists() else None
    if not found:
        raise JobJarError(f"`{name}` not found: the Flink job is compiled with a JDK (17+); "
                            "install one (Debian: apt install openjdk-17-jdk-headless) or set JAVA_HOME")
    return found


def ensure_job_jar(jars_dir: Path) -> Path:
    """The jar of the current sources in ``jars_dir``, compiled if missing; idempotent."""
    jars_dir = Path(jars_dir)
    jar = jars_dir / f"streamrec-job-{source_hash()}.jar"
    if jar.is_file():
        return jar
    verify_jars(jars_dir)  # compiled against the Kafka connector
    with tempfile.TemporaryDirectory(dir=jars_dir, prefix=".job-") as tmp:
        classes = Path(tmp) / "classes"
        classes.mkdir()
        classpath = os.pathsep.join([str(_flink_lib() / "*"), *map(str, jar_paths(jars_dir))])
        cmd = [_tool("javac"), "--release", "17", "-nowarn", "-d", str(classes), "-cp", classpath, *map(str, _sources())]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise JobJarError(f"compiling the Flink job failed:\n{result.stderr.strip()}")
        staged = Path(tmp) / jar.name
        result = subprocess.run([_tool("jar"), "--create", "--file", str(staged), "-C", str(classes), "."],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise JobJarError(f"packaging the Flink job failed:\n{result.stderr.strip()}")
        os.replace(staged, jar)  # atomic: a half-written jar is never picked up
    _prune_old_jars(jars_dir, keep=jar)
    return jar


# Jars of other source versions kept beside the current one: a job being submitted from an
# older checkout (or a test run while the sources change) may still be about to load its jar.
KEEP_OTHER_JARS = 2


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
