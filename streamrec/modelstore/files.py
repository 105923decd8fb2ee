"""One model's files in the model store, on one ``pyarrow.fs`` filesystem: where they lie
(store.py describes the layout) and the few operations the reader and the writer share.

Paths are strings on that filesystem (absolute local paths, or ``bucket/key`` on an object
store); file contents are ``bytes``.
"""

from __future__ import annotations

import os
import re
import uuid

import pyarrow.fs as pafs

from streamrec.contracts.delta import MANIFEST

# Version numbers as the store writes them: ASCII digits only (str.isdigit() also takes '²'),
# at most the 12 of a version directory's name.
VERSION_NUMBER = re.compile(r"[0-9]{1,12}")


class StoreFiles:
    """The files of model ``model`` under ``root`` (a local path or any ``pyarrow.fs`` URI:
    ``file://``, ``s3://``, ``hdfs://``).

    Attributes: ``fs`` (the filesystem), ``model``, ``base`` (``<root>/<model>``),
    ``versions_dir`` and ``compacted_dir``, and ``renames_dirs``: whether a directory can be
    renamed into place (False on S3 and GCS, whose single-object PUTs are atomic instead).
    """

    def __init__(self, root: str, model: str) -> None:
        if not model or "/" in model or model.startswith("."):
            raise ValueError(f"invalid model name {model!r}")
        self.fs, base = pafs.FileSystem.from_uri(root) if "://" in root else (pafs.LocalFileSystem(), os.path.abspath(root))
        self.model = model
        self.base = f"{base.rstrip('/')}/{model}"
        self.versions_dir = f"{self.base}/versions"
        self.compacted_dir = f"{self.base}/compacted"
        # pyarrow's move on S3 and GCS copies keys one by one, and refuses a "directory"
        self.renames_dirs = self.fs.type_name not in ("s3", "gcs")

    def version_dir(self, version: int, image: bool = False) -> str:
        """``versions/<version:012d>``, or ``compacted/<version:012d>`` for its image."""
        return f"{self.compacted_dir if image else self.versions_dir}/{version:012d}"

    def staging_dir(self, version: int, image: bool = False) -> str:
        """Where a writer puts ``version``'s files until they are visible: a fresh
        ``.tmp-<version>-<random>`` beside the final directory, or the final directory itself
        where directories cannot be renamed (the manifest, written last, makes it visible)."""
        final = self.version_dir(version, image)
        if not self.renames_dirs:
            return final
        return f"{self.compacted_dir if image else self.versions_dir}/.tmp-{version:012d}-{uuid.uuid4().hex[:8]}"

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def read(self, path: str) -> bytes:
        """The whole file (FileNotFoundError when it is not there)."""
        with self.fs.open_input_stream(path) as src:
            return src.read()

    def write(self, path: str, data: bytes) -> None:
        """Create or overwrite ``path`` in place (readers may see a part: see replace_file)."""
        with self.fs.open_output_stream(path) as out:
            out.write(data)

    def replace_file(self, path: str, data: bytes) -> None:
        """Readers see the old content or the new, never a part (one PUT on object stores)."""
        if not self.renames_dirs:
            self.write(path, data)
            return
        folder, name = path.rsplit("/", 1)
        tmp = f"{folder}/.{name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.write(tmp, data)
            self.fs.move(tmp, path)
        except BaseException:  # a full disk, say: no temp file left behind
            try:
                self.fs.delete_file(tmp)
            except OSError:
                pass
            raise

    def listed(self, directory: str) -> list[int]:
        """The versions in ``directory`` (``versions_dir`` or ``compacted_dir``) that have a
        manifest, ascending (a directory without one is being written, or was torn)."""
        if not self.exists(directory):
            return []
        out = []
        for info in self.fs.get_file_info(pafs.FileSelector(directory)):
            name = info.base_name
            if info.type == pafs.FileType.Directory and VERSION_NUMBER.fullmatch(name) and self.exists(f"{info.path}/{MANIFEST}"):
                out.append(int(name))
        return sorted(out)
