"""One rule for every command that takes a run: a run's folder is its logger's ``version_N`` (the CLI's
``logs/<strategy>/version_N``, a script's ``logs/lightning_logs/version_N``), and a logger's folder stands for its
latest run holding what the command reads (``advise``: ``timing_summary.json``; the trace tool: traces;
``--ckpt_path``: a checkpoint). Standard library only: the CLI checks ``--ckpt_path`` before importing Lightning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

VERSION = re.compile(r"version_(\d+)")  # Lightning's loggers' run folders


def run_folder(path: str | Path, holds: Callable[[Path], bool], what: str, fix: str) -> Path:
    """``path`` if ``holds(path)``, else its ``version_N`` folder of the highest N that holds ``what``; otherwise
    ``ValueError`` naming ``what`` and ``fix``."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} {'is not a folder' if path.exists() else 'does not exist'}; pass a run's folder "
                         "(e.g. logs/bucketed_ddp/version_0) or its logger's (logs/bucketed_ddp: its latest run)")
    if holds(path):
        return path
    versions = sorted((int(match[1]), child) for child in path.iterdir()
                      if (match := VERSION.fullmatch(child.name)) and child.is_dir())
    for _, version in reversed(versions):
        if holds(version):
            return version
    below = f", nor do its {len(versions)} version_N folders" if versions else ""
    raise ValueError(f"{path} holds no {what}{below}; {fix}")
