"""Writing a file whole or not at all: ``write_atomically`` and ``write_json_atomically``. Pure Python.

Every result, profile and report this package writes goes through here, so a reader (a plot, a resumed sweep, a
person with ``cat``) sees the old file or the new one, never half of one, even if the writer is killed mid-write:

1. Create a temporary file with a unique name next to ``path`` (same directory, so the same filesystem), with
   ``O_EXCL`` so that two writers of the same path never share one. Its permissions follow the umask, as a
   plain ``open`` would give (``tempfile.mkstemp`` would make it 0600).
2. Write the content, flush, ``fsync``: the bytes are on disk before the name points at them.
3. ``os.replace`` it over ``path``: atomic within one filesystem, on POSIX and on Windows.
4. On any error (the disk full, a ``KeyboardInterrupt``), remove the temporary file and re-raise: ``path`` keeps
   its old content and nothing is left behind.

>>> import tempfile, pathlib
>>> with tempfile.TemporaryDirectory() as folder:
...     path = write_json_atomically(pathlib.Path(folder) / "sub" / "a.json", {"step_ms": 12.5})
...     print(path.read_text(), end="")
...     print(sorted(p.name for p in path.parent.iterdir()))
{
  "step_ms": 12.5
}
['a.json']
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["write_atomically", "write_json_atomically"]


def write_atomically(path: str | os.PathLike, content: str | bytes) -> Path:
    """Write ``content`` (text as UTF-8, or bytes) to ``path`` whole or not at all (module docstring); returns
    the path. Missing parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8") if isinstance(content, str) else content
    # 8 random bytes: a clash is as good as impossible, and O_EXCL refuses one rather than sharing the file.
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json_atomically(path: str | os.PathLike, document: Any, *, indent: int = 2, **dumps_kwargs: Any) -> Path:
    """``json.dumps(document, indent=indent, **dumps_kwargs)`` and a newline, written with ``write_atomically``."""
    return write_atomically(path, json.dumps(document, indent=indent, **dumps_kwargs) + "\n")
