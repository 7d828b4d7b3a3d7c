"""The GPU study's command line (``GPUStudyConfig``) and the checkout whose configs and tests it reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


def repository_root(root: str | None = None) -> Path:
    """The checkout with ``configs/bench`` the stages read: ``root``, else the one holding this package, else cwd."""
    candidates = [Path(root)] if root else [Path(__file__).resolve().parents[3], Path.cwd()]
    for candidate in candidates:
        if (candidate / "configs" / "bench").is_dir():
            return candidate.resolve()
    raise ValueError(f"no configs/bench under {' or '.join(map(str, candidates))}: the study reads the repository's "
                     "configs and tests; run it from a checkout of the repository or pass --root CHECKOUT")


@dataclass
class GPUStudyConfig:
    """The whole GPU study in one command: ordered stages, each writing its files as soon as it ends."""

    out: Optional[str] = None
    """Directory of every output (required): stages.json, results.md, each stage's files."""
    budget_min: float = 9.0
    """Minutes this call may take; a stage whose estimate does not fit what is left waits for ``--resume true``."""
    cpu_dry_run: bool = False
    """Run every stage on CPU with the tiny preset, producing the same files; stages that need CUDA are skipped."""
    stages: Optional[list[str]] = None
    """Run only these stages (by name); default: all. The others are ``skipped: not selected``."""
    root: Optional[str] = None
    """The checkout whose configs/ and tests/ the stages use; default: the one holding this package, else cwd."""
    resume: bool = False
    """Keep the ``ok`` stages of ``--out``'s stages.json and run the rest (required where ``--out`` holds a study)."""
    archive: Optional[str] = None
    """Write a ``.tar.gz`` of what is worth committing (at most 16 MiB) here when the call ends, finished or not."""
    commit: Optional[str] = None
    """The code's git commit, for a copy without ``.git``; default: HEAD, else ``$LIGHTNING_DDP_COMMIT``."""

    def __post_init__(self) -> None:
        """Refuses a missing ``--out``, a budget not > 0 minutes, an unknown or empty ``--stages``, a ``--root``
        that is no checkout, an ``--archive`` not ending .tar.gz and a ``--commit`` that is not a hash."""
        if not self.out:
            raise ValueError("`--out` is missing; give the directory for the study's files, e.g. `--out gpu_study`")
        if isinstance(self.budget_min, bool) or not isinstance(self.budget_min, (int, float)) \
                or not self.budget_min > 0:
            raise ValueError(f"`--budget_min` must be > 0 minutes, got {self.budget_min!r}; e.g. `--budget_min 9`")
        for flag in ("cpu_dry_run", "resume"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"`--{flag}` must be true or false, got {getattr(self, flag)!r}")
        if self.stages is not None:
            from lightning_ddp.bench.gpu_study.stages import STAGES  # the study's own stages, their names

            names = [stage.name for stage in STAGES]
            unknown = [name for name in self.stages if name not in names]
            if unknown or not self.stages:
                problem = f"unknown stage {unknown[0]!r} in `--stages`" if unknown else "`--stages` is empty"
                raise ValueError(f"{problem}; choose from {', '.join(names)}, or leave it out")
        if self.root is not None:
            repository_root(self.root)
        if self.archive is not None and not self.archive.endswith(".tar.gz"):
            raise ValueError(f"`--archive` must name a .tar.gz file, got {self.archive!r}; "
                             "e.g. `--archive study.tar.gz`")
        if self.commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise ValueError(f"`--commit` must be a git commit hash (7-40 hex digits), got {self.commit!r}; e.g. "
                             "`--commit $(git rev-parse HEAD)` where the checkout has .git")
