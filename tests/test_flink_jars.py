"""The Flink job's jar, built by Maven (pipelines/job_jar.py): what goes in it, built once per
source version, a new jar for a changed source, and clear errors without Maven or a jar."""

import shutil
import zipfile

import pytest

from streamrec.pipelines import job_jar
from streamrec.pipelines.job_jar import JobJarError, ensure_job_jar, verify_job_jar
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jars_dir(tmp_path_factory):
    """A cache holding the jar of the current sources, built once for this module."""
    path = tmp_path_factory.mktemp("jars")
    ensure_job_jar(path)
    return path


def test_the_jar_holds_the_job_and_the_connector_but_not_flink(jars_dir):
    jar = verify_job_jar(jars_dir)
    names = set(zipfile.ZipFile(jar).namelist())
    assert {"streamrec/flink/SampleJob.class", "org/apache/flink/connector/kafka/source/KafkaSource.class",
            "org/apache/kafka/clients/producer/KafkaProducer.class"} <= names
    assert "org/apache/flink/streaming/api/environment/StreamExecutionEnvironment.class" not in names  # provided
    assert sorted(p.name for p in jars_dir.iterdir()) == [jar.name]  # no build directory left behind
    assert not (job_jar.SOURCE_DIR / "target").exists()


def test_an_unchanged_source_is_never_rebuilt(jars_dir, monkeypatch, tmp_path):
    jar = job_jar.job_jar_path(jars_dir)
    before = jar.stat().st_mtime_ns
    monkeypatch.setenv("PATH", str(tmp_path))  # no Maven: a rebuild would fail
    assert ensure_job_jar(jars_dir) == jar and jar.stat().st_mtime_ns == before


def test_a_changed_source_gives_a_new_jar(jars_dir, monkeypatch, tmp_path):
    sources = tmp_path / "java"
    shutil.copytree(job_jar.SOURCE_DIR, sources)
    old = job_jar.job_jar_path(jars_dir)
    with open(sources / "streamrec" / "flink" / "SampleJob.java", "a") as fh:
        fh.write("// changed\n")
    monkeypatch.setattr(job_jar, "SOURCE_DIR", sources)
    new = ensure_job_jar(jars_dir)
    assert new != old and new.name.startswith("streamrec-job-") and old.is_file()  # the old one is kept
    assert not (sources / "target").exists()


def test_without_maven_the_error_says_what_to_install(tmp_path):
    python_only = tmp_path / "bin"
    python_only.mkdir()
    result = run_cli("setup", "flink-job", "--jars-dir", str(tmp_path / "jars"), env={"PATH": str(python_only)})
    assert result.returncode == 3 and "`mvn` not found" in result.stderr and "apt install maven" in result.stderr
    assert not (tmp_path / "jars").exists()


def test_verify_refuses_a_missing_or_damaged_jar(tmp_path):
    result = run_cli("setup", "flink-job", "--verify", "--jars-dir", str(tmp_path))
    assert result.returncode == 3 and "streamrec setup flink-job" in result.stderr
    job_jar.job_jar_path(tmp_path).write_bytes(b"not a jar")
    with pytest.raises(JobJarError, match="is not the job's jar"):
        verify_job_jar(tmp_path)
