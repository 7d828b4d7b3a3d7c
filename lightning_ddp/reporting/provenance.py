"""Where a result came from: the git commit of the code and whether the tree was dirty (``git_state``), the
command that ran it, where and when (``invocation``), and the package versions (``package_version``).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

# The environment variable that names the commit where the code is a copy without ``.git`` (a GPU machine's).
COMMIT_VARIABLE = "LIGHTNING_DDP_COMMIT"
# Where the committed results live: data the benchmarks write, not code. A result remade there does not make the
# next command's code dirty (the projections are regenerated one after another into sibling folders).
RESULTS_DIR = "benchmarks/results"

_REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None  # not a git checkout (e.g. an installed package)


def repo_relative(value: str) -> str:
    """``value`` (a path or an argument such as ``--out=PATH``) relative to the repository's root when inside it."""
    root = str(_REPO)
    if value == root:
        return "."
    return value.replace(root + os.sep, "")


def invocation() -> dict[str, Any]:
    """``{"created", "command", "cwd", "python", "platform"}`` of this process, paths ``repo_relative``."""
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [repo_relative(arg) for arg in sys.argv],
        "cwd": repo_relative(os.getcwd()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows of it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, or ``None`` if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_state(ignore: Iterable[str | os.PathLike] = ()) -> dict[str, Any]:
    """``{"git_commit", "git_commit_source", "git_dirty", "git_changed"}``: HEAD, whether the code differs from it
    (tracked or new files outside ``RESULTS_DIR`` and ``ignore``, the run's own output), and which (at most 20).
    Outside a checkout: the commit ``$LIGHTNING_DDP_COMMIT`` (its source named so) or None, and dirty unknown (None).
    """
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=all")
    changed = [line[3:] for line in status.splitlines() if line.strip()] if status is not None else None
    prefixes = [RESULTS_DIR, *(repo_relative(str(Path(path).resolve())) for path in ignore)]
    if changed is not None:  # a changed file inside an ignored directory (``=all`` lists files, never folders)
        changed = [c for c in changed if not any(c.rstrip("/") == p or c.startswith(p + "/") for p in prefixes)]
    source = "git" if commit else None
    if not commit and os.environ.get(COMMIT_VARIABLE):
        commit, source = os.environ[COMMIT_VARIABLE], COMMIT_VARIABLE
    return {
        "git_commit": commit.strip() if commit else None,
        "git_commit_source": source,
        "git_dirty": bool(changed) if changed is not None else None,
        "git_changed": changed[:20] if changed is not None else None,
    }


def code_version(state: dict[str, Any] | None = None) -> str:
    """The code a report came from, as its sentence says it: ``commit 2685a5d1b2c3``, with ``with uncommitted
    changes`` after it where ``state`` (default: ``git_state()``) says the code was dirty."""
    state = git_state() if state is None else state
    if not state.get("git_commit"):  # outside a checkout, or results recorded without their git state
        return "an unknown commit"
    changes = " with uncommitted changes" if state.get("git_dirty") else ""
    return f"commit {state['git_commit'][:12]}{changes}"
