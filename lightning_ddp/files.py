"""Writing a file whole or not at all (a temporary file beside it, fsynced, then ``os.replace``d over it); every
file this package writes goes through here. Pure Python.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_atomically(path: str | os.PathLike, content: str | bytes) -> Path:
    """Write ``content`` (UTF-8 text or bytes) to ``path`` whole or not at all, parents created; returns the path."""
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
