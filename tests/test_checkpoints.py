"""Finding the checkpoint a new submission resumes from, on a local path and on S3 (a real
S3 API server): what `streamrec pipeline submit` does before it hands Flink the path."""

from __future__ import annotations

import time
from dataclasses import replace

import pyarrow.fs as pafs

from streamrec.pipelines.checkpoints import checkpoint_uri, latest_checkpoint, prepare
from streamrec.pipelines.flink_runner import RunOptions, flink_config
from streamrec.plumbing.config import load_config
from tests.conftest import S3_BUCKET


def _write(fs: pafs.FileSystem, path: str, data: bytes = b"x") -> None:
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)


def _layout(fs: pafs.FileSystem, root: str, clock_step_s: float) -> None:
    """Two jobs' checkpoints as Flink leaves them; the newest complete one is job-b's chk-7
    (checkpoint numbers count per job: only the time tells which job came last)."""
    _write(fs, f"{root}/job-a/chk-12/_metadata")
    _write(fs, f"{root}/job-a/shared/state-1")
    time.sleep(clock_step_s)
    _write(fs, f"{root}/job-b/chk-7/_metadata")
    _write(fs, f"{root}/job-b/chk-8/state-2")  # in progress: no _metadata yet
    _write(fs, f"{root}/job-b/chk-x/_metadata")  # not a checkpoint
    _write(fs, f"{root}/stray-file")


def test_latest_checkpoint_on_a_local_path(tmp_path, monkeypatch):
    location = tmp_path / "checkpoints"
    assert latest_checkpoint(location) is None  # nothing there yet: not an error
    prepare(location)
    assert location.is_dir() and latest_checkpoint(location) is None
    _layout(pafs.LocalFileSystem(), str(location), 0.05)
    assert latest_checkpoint(location) == (location / "job-b" / "chk-7").as_uri()
    monkeypatch.chdir(tmp_path)  # a relative path is resolved, and file:// URIs work the same
    assert latest_checkpoint("checkpoints") == latest_checkpoint(location.as_uri()) == (location / "job-b" / "chk-7").as_uri()


def test_latest_checkpoint_on_s3(s3_endpoint):
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", region="us-east-1")
    location = f"s3://{S3_BUCKET}/flink/checkpoints?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
    assert latest_checkpoint(location) is None
    prepare(location)  # object stores need no directories: nothing to do, no error
    _layout(fs, f"{S3_BUCKET}/flink/checkpoints", 1.1)  # S3 times objects to the second
    assert latest_checkpoint(location) == f"s3://{S3_BUCKET}/flink/checkpoints/job-b/chk-7"


def test_flink_is_given_uris_as_they_are_and_paths_as_file_uris(tmp_path):
    def checkpoint_dir_of(location) -> str:
        opts = replace(RunOptions.from_config(load_config()), checkpoint_dir=location)
        return flink_config(opts, None)["execution.checkpointing.dir"]

    assert checkpoint_dir_of("s3://ads/checkpoints/") == "s3://ads/checkpoints"
    assert checkpoint_dir_of("s3://ads/ck?endpoint_override=h:1") == "s3://ads/ck"
    assert checkpoint_dir_of("hdfs://nn:8020/flink/ck") == "hdfs://nn:8020/flink/ck"
    assert checkpoint_dir_of(tmp_path / "ck") == (tmp_path / "ck").as_uri() == checkpoint_uri(tmp_path / "ck")
