"""Apache Kafka's broker jars: resolved from Maven Central by Maven, cached, verified by sha256.

``kafka_server/pom.xml`` (beside this module) names the broker (``org.apache.kafka:kafka_2.13``,
KRaft) and its logging binding; ``kafka_server/jars.sha256`` pins every jar Maven resolves for
it. ``ensure_kafka_jars`` resolves them once into the user cache (``streamrec setup kafka``,
run by ``make setup``); every ``kafka up`` checks them again, so a damaged or partial cache is
refused with the command that repairs it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from streamrec.plumbing.processes import find_tool

SPEC_DIR = Path(__file__).parent / "kafka_server"
POM = SPEC_DIR / "pom.xml"
LOCK = SPEC_DIR / "jars.sha256"
KAFKA_VERSION = "4.3.1"
SETUP_HINT = "run `streamrec setup kafka` (`make setup` does)"


class KafkaJarsError(RuntimeError):
    """The broker's jars are missing, damaged, or cannot be resolved."""


def default_jars_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "streamrec" / f"kafka-{KAFKA_VERSION}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pinned_jars() -> dict[str, str]:
    """Jar file name -> sha256, as pinned in ``jars.sha256``."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip():
            digest, name = line.split()
            pins[name] = digest
    return pins


def verify_kafka_jars(jars_dir: Path) -> list[Path]:
    """The pinned jars in ``jars_dir``, each checked; KafkaJarsError names the first that is
    missing or differs."""
    jars_dir = Path(jars_dir)
    paths = []
    for name, expected in pinned_jars().items():
        path = jars_dir / name
        if not path.is_file():
            raise KafkaJarsError(f"Kafka broker jar {path} is missing: {SETUP_HINT}")
        actual = sha256_of(path)
        if actual != expected:
            raise KafkaJarsError(f"Kafka broker jar {path}: sha256 {actual} is not the pinned {expected}; "
                                 f"delete {jars_dir} and {SETUP_HINT}")
        paths.append(path)
    return paths


def _tool(name: str, why: str) -> str:
    found = find_tool(name)
    if not found:
        raise KafkaJarsError(f"`{name}` not found: {why}")
    return found


def java_binary() -> str:
    return _tool("java", "the embedded Kafka broker runs on a JVM (17+); install one "
                         "(Debian: apt install openjdk-17-jre-headless) or set JAVA_HOME")


def ensure_kafka_jars(jars_dir: Path | None = None) -> Path:
    """``jars_dir`` holding exactly the pinned jars; resolved with Maven when they are not
    there yet. Idempotent: nothing is resolved when the cache verifies. The jars are staged
    beside the cache and moved in whole, so a failed or interrupted resolve leaves the cache
    as it was."""
    jars_dir = Path(jars_dir or default_jars_dir())
    try:
        verify_kafka_jars(jars_dir)
        return jars_dir
    except KafkaJarsError:
        pass
    mvn = _tool("mvn", "the Kafka broker's jars are resolved from Maven Central with Maven 3 "
                       "(Debian: apt install maven)")
    jars_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=jars_dir.parent, prefix=f".{jars_dir.name}-") as tmp:
        staged = Path(tmp) / "jars"
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(POM), "dependency:copy-dependencies",
               "-DincludeScope=runtime", f"-DoutputDirectory={staged}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KafkaJarsError(f"Maven could not resolve Apache Kafka {KAFKA_VERSION} (exit {result.returncode}):\n"
                                 f"{(result.stdout + result.stderr).strip()[-3000:]}")
        verify_kafka_jars(staged)
        extra = sorted({p.name for p in staged.iterdir()} - set(pinned_jars()))
        for name in extra:  # a resolver that brings more than the pins: only the pinned jars run
            (staged / name).unlink()
        old = Path(tmp) / "old"
        if jars_dir.exists():
            jars_dir.rename(old)
        staged.rename(jars_dir)
    return jars_dir
