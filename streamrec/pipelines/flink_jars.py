"""The Kafka connector jars for PyFlink, fetched from PyPI and verified by sha256.

PyFlink 2.3.0 ships without a Kafka connector and Maven Central is out of reach, so the
two jars are taken out of the ``shigawire-apache-flink-libraries==2.0.0.post1`` wheel.
That wheel is only *downloaded*, never installed (installing it would drop Flink 2.0
core jars into ``pyflink/lib``). The checksums below pin the exact wheel and jars.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "shigawire-apache-flink-libraries==2.0.0.post1"
WHEEL_SHA256 = "aaa65537d3f0c0ff279185d8243024f0efd95788ba044bf249ba0f40b69289cd"
JAR_SHA256 = {
    "flink-connector-kafka.jar": "842885a51c768b2f31c946a2071656c166ee8cc6d3c02fe6c557e134e03bf228",
    "kafka-clients.jar": "7568b998572d256f0b7bc0afdc1b7a2588b8b08415c62ce314c864a6851ae9d9",
}
_MEMBER_DIR = "pyflink/lib/"


class ChecksumMismatch(RuntimeError):
    """A downloaded or cached file is not the file we pinned."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def jar_paths(jars_dir: Path) -> list[Path]:
    return [Path(jars_dir) / name for name in JAR_SHA256]


def jar_urls(jars_dir: Path) -> list[str]:
    """``file://`` URLs for ``StreamExecutionEnvironment.add_jars`` / ``pipeline.jars``."""
    return [p.resolve().as_uri() for p in jar_paths(jars_dir)]


def verify_jars(jars_dir: Path) -> None:
    """Raise FileNotFoundError or ChecksumMismatch unless both jars are present and exact."""
    for path in jar_paths(jars_dir):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; run `streamrec setup flink-jars`")
        actual = sha256_of(path)
        expected = JAR_SHA256[path.name]
        if actual != expected:
            raise ChecksumMismatch(f"{path}: sha256 {actual} does not match the pinned {expected}")


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(dest), WHEEL_REQUIREMENT]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} with pip (exit {result.returncode}):\n{result.stderr.strip()}")
    return wheels[0]


def ensure_jars(jars_dir: Path, wheel: Path | None = None) -> list[Path]:
    """Make both jars available in ``jars_dir``; idempotent.

    Nothing is downloaded when the cached jars verify. Otherwise the wheel (``wheel`` if
    given, else downloaded with pip) is checked against its pinned sha256 *before* any
    jar is extracted, and each jar is checked again before it is moved into place.
    On any mismatch the cache is left as it was and ChecksumMismatch is raised.
    """
    jars_dir = Path(jars_dir)
    try:
        verify_jars(jars_dir)
        return jar_paths(jars_dir)
    except ChecksumMismatch as exc:
        log.warning("cached connector jar is corrupt, fetching it again: %s", exc)
    except FileNotFoundError:
        pass
    jars_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=jars_dir, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        wheel_path = Path(wheel) if wheel else _download_wheel(tmp_path)
        actual = sha256_of(wheel_path)
        if actual != WHEEL_SHA256:
            raise ChecksumMismatch(
                f"{wheel_path.name}: sha256 {actual} does not match the pinned {WHEEL_SHA256}; refusing to use it"
            )
        with zipfile.ZipFile(wheel_path) as zf:
            for name, expected in JAR_SHA256.items():
                staged = tmp_path / name
                with zf.open(_MEMBER_DIR + name) as src, open(staged, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                if sha256_of(staged) != expected:
                    raise ChecksumMismatch(f"{name} inside {wheel_path.name} does not match the pinned {expected}")
        for name in JAR_SHA256:
            os.replace(tmp_path / name, jars_dir / name)  # atomic: readers see old or new, never half
    verify_jars(jars_dir)
    return jar_paths(jars_dir)
