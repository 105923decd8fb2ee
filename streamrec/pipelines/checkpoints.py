"""Where the Flink job's checkpoints live, and which one a new submission resumes from.

``flink.checkpoint_dir`` is a local path (the embedded mini-cluster, or a cluster on this
host) or a URI the cluster's TaskManagers can all write (``s3://``, ``hdfs://``,
``file://`` on a shared mount). Flink writes ``<dir>/<job id>/chk-N/_metadata`` and the
state files beside it; this module only has to find the newest complete ``chk-N``, which it
lists through ``pyarrow.fs`` (the same file-system layer as the model store), so a resume
works the same on all of them.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs


def checkpoint_uri(location: str | Path, for_flink: bool = False) -> str:
    """``location`` as a URI: URIs unchanged, paths as absolute ``file://`` URIs.

    ``for_flink``: without a ``?query``; options such as ``endpoint_override`` are for
    pyarrow's listing here, while the cluster's own file-system plugin has its settings.
    """
    text = str(location)
    uri = text if "://" in text else Path(text).resolve().as_uri()
    return uri.split("?", 1)[0].rstrip("/") if for_flink else uri


def is_local(location: str | Path) -> bool:
    return checkpoint_uri(location).startswith("file://")


def prepare(location: str | Path) -> None:
    """Create a local checkpoint directory (object stores need none; Flink creates the rest)."""
    if is_local(location):
        fs, root = pafs.FileSystem.from_uri(checkpoint_uri(location))
        fs.create_dir(root, recursive=True)


def latest_checkpoint(location: str | Path) -> str | None:
    """The newest complete checkpoint (a ``chk-N`` with its ``_metadata``) of any job under
    ``location``, as a URI; None when there is none (or the location does not exist yet)."""
    uri = checkpoint_uri(location)
    fs, root = pafs.FileSystem.from_uri(uri)
    base = checkpoint_uri(location, for_flink=True)
    prefix = base[: len(base) - len(root.rstrip("/"))] if base.endswith(root.rstrip("/")) else ""
    best: tuple[float, int, str] | None = None
    for job in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if job.type != pafs.FileType.Directory:
            continue
        for chk in fs.get_file_info(pafs.FileSelector(job.path, allow_not_found=True)):
            number = chk.base_name.removeprefix("chk-")
            if chk.type != pafs.FileType.Directory or not chk.base_name.startswith("chk-") or not number.isdigit():
                continue
            meta = fs.get_file_info(f"{chk.path}/_metadata")
            if meta.type == pafs.FileType.File:
                stamp = meta.mtime.timestamp() if meta.mtime else 0.0
                if best is None or (stamp, int(number)) > best[:2]:
                    best = (stamp, int(number), chk.path)
    return prefix + best[2] if best else None
