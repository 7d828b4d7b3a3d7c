"""One ``.tar.gz`` of what a GPU study is worth committing, small enough to come back from a GPU machine.

Files ending in ``KEPT_SUFFIXES`` of at most ``FILE_LIMIT`` bytes each, at most ``ARCHIVE_LIMIT`` in all (the largest
left out first; ``stages.json`` and ``results.md`` always in), never a sweep's ``runs/`` folders;
``archive_contents.json`` inside lists what was left out. Written to a temporary file and renamed: whole or absent.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ARCHIVE_LIMIT", "ArchiveContents", "FILE_LIMIT", "KEPT_SUFFIXES", "select_files", "write_archive"]

ARCHIVE_LIMIT = 16 * 2**20  # bytes before compression: a file the GPU machine sends back may have 16 MiB
FILE_LIMIT = 2 * 2**20  # bytes one file may have: a raw profiler trace is larger, its picture is not
KEPT_SUFFIXES = (".json", ".csv", ".md", ".png", ".svg", ".xml", ".log", ".txt")
LEFT_OUT_FOLDERS = ("runs",)  # a sweep's per-cell folders (machine paths and ports); results.csv summarises them
ALWAYS = ("stages.json", "results.md")
CONTENTS = "archive_contents.json"


@dataclass
class ArchiveContents:
    """What an archive holds and what was left out (relative paths)."""

    files: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # "PATH (why)" of each file left out that a suffix would keep
    size_bytes: int = 0  # before compression


def select_files(out: Path, limit: int = ARCHIVE_LIMIT, file_limit: int = FILE_LIMIT) -> ArchiveContents:
    """The files of ``out`` to archive, smallest first among those that compete for room."""
    candidates = []
    for path in sorted(out.rglob("*")):
        relative = path.relative_to(out)
        if not path.is_file() or relative.name == CONTENTS or path.suffix not in KEPT_SUFFIXES:
            continue
        if any(part in LEFT_OUT_FOLDERS for part in relative.parts[:-1]):
            continue
        candidates.append((relative.as_posix(), path.stat().st_size))
    contents = ArchiveContents()
    must = [(name, size) for name, size in candidates if name in ALWAYS]
    rest = sorted((c for c in candidates if c[0] not in ALWAYS), key=lambda c: (c[1], c[0]))
    for name, size in must + rest:
        if name not in ALWAYS and size > file_limit:
            contents.left_out.append(f"{name} ({size:,} B: over {file_limit:,} B a file)")
        elif name not in ALWAYS and contents.size_bytes + size > limit:
            contents.left_out.append(f"{name} ({size:,} B: the archive would pass {limit:,} B)")
        else:
            contents.files.append(name)
            contents.size_bytes += size
    contents.files.sort()
    return contents


def write_archive(out: Path, archive: Path) -> ArchiveContents:
    """Write ``archive`` (a ``.tar.gz``) of ``out``'s files that ``select_files`` keeps, with ``CONTENTS``."""
    contents = select_files(out)
    archive.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=archive.parent, prefix=f".{archive.name}.", suffix=".tmp")
    os.close(handle)
    try:
        with tarfile.open(temporary, "w:gz") as tar:
            for name in contents.files:
                tar.add(out / name, arcname=name, recursive=False)
            listing = json.dumps({"files": contents.files, "left_out": contents.left_out,
                                  "size_bytes": contents.size_bytes}, indent=2).encode()
            info = tarfile.TarInfo(CONTENTS)
            info.size = len(listing)
            tar.addfile(info, io.BytesIO(listing))
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would keep the archive from whoever unpacks it
        os.replace(temporary, archive)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return contents
