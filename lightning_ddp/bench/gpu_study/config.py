"""What a GPU study run is: the command line (``GPUStudyConfig``) and the sizes of its work (``Scale``).

``GPU_SCALE`` fits the whole study in two 9-minute calls on one H100 or H200; ``DRY_RUN_SCALE`` shrinks every
size to the tiny preset on CPU, so ``--cpu_dry_run true`` runs every stage's code in minutes (docs/gpu.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["DRY_RUN_SCALE", "GPU_SCALE", "GPUStudyConfig", "STAGE_NAMES", "Scale", "scale_of"]

STAGE_NAMES: tuple[str, ...] = (
    "environment", "cuda_tests", "compute", "strategies", "one_gpu_pair", "traces", "ready_times", "timer_overhead",
)
"""The stages, in the order they run (``stages.STAGES`` defines them; a test keeps the two lists equal)."""


@dataclass(frozen=True)
class Scale:
    """The sizes of every stage's work; each field is prefixed by the stage it sizes (warm-up steps are left out
    of the medians, ``compute_max_batch`` caps the pre-flight's batch)."""

    device: str  # cuda, or cpu for the dry run
    precision: str  # of the stages' fits (stage compute measures both bf16-mixed and 32-true)
    compute_preset: str
    compute_seq_len: int
    compute_max_batch: int
    compute_steps: int
    compute_warmup: int
    strategies_preset: str
    strategies_batch: int
    strategies_seq_len: int
    strategies_steps: int
    strategies_warmup: int
    equivalence_preset: str  # stage one_gpu_pair: 2 ranks against one process
    equivalence_steps: int
    sweep_config: str  # stage one_gpu_pair's short sweep, relative to the repository root
    sweep_strategies: Optional[tuple[str, ...]]  # its grid.strategies, None: the config's (the sweep adds the
    # reference and ddp)
    trace_preset: str
    profile_preset: str  # stage ready_times
    profile_batch: int
    profile_seq_len: int
    profile_steps: int
    overhead_preset: str  # stage timer_overhead
    overhead_steps: int
    overhead_warmup: int
    overhead_repeats: int  # off/on pairs


GPU_SCALE = Scale(
    device="cuda", precision="bf16-mixed",
    compute_preset="xl", compute_seq_len=512, compute_max_batch=256, compute_steps=8, compute_warmup=3,
    strategies_preset="medium", strategies_batch=8, strategies_seq_len=512, strategies_steps=20, strategies_warmup=5,
    equivalence_preset="tiny", equivalence_steps=3,  # the steps the tolerances were calibrated at
    sweep_config="configs/bench/gpu_study.yaml",
    sweep_strategies=None,
    trace_preset="small",
    profile_preset="xl", profile_batch=4, profile_seq_len=512, profile_steps=12,  # the published 2-GPU xl runs
    overhead_preset="small", overhead_steps=25, overhead_warmup=5, overhead_repeats=2,  # 6 cold fits, ~2 minutes
)
"""One H100 (80 GB) or H200 (141 GB): about 17 minutes of stages, two calls of ``--budget_min 9``."""

DRY_RUN_SCALE = Scale(
    device="cpu", precision="32-true",  # bf16 autocast on CPU is several times slower than fp32
    compute_preset="tiny", compute_seq_len=32, compute_max_batch=2, compute_steps=2, compute_warmup=1,
    strategies_preset="tiny", strategies_batch=2, strategies_seq_len=32, strategies_steps=4, strategies_warmup=1,
    equivalence_preset="tiny", equivalence_steps=3,
    sweep_config="configs/bench/gpu_study.yaml",
    sweep_strategies=("ddp",),  # the sweep adds the reference: 2 cells, the sweep's code paths at the least cost
    trace_preset="tiny",
    profile_preset="tiny", profile_batch=2, profile_seq_len=32, profile_steps=5,
    overhead_preset="tiny", overhead_steps=6, overhead_warmup=2, overhead_repeats=1,
)
"""The same stages on CPU with the tiny preset: every code path but the CUDA lines, in minutes on 2 cores."""


@dataclass
class GPUStudyConfig:
    """The whole GPU study in one command: ordered stages, each writing its files as soon as it ends.

    ``python -m lightning_ddp.bench.gpu_study --out DIR --resume true --archive study.tar.gz``
    """

    out: Optional[str] = None
    """Directory of every output (required): stages.json, results.md, each stage's files."""
    budget_min: float = 9.0
    """Minutes this call may take, from its start; a stage whose estimate does not fit what is left is skipped
    (``skipped: budget``) for a later ``--resume true`` call."""
    cpu_dry_run: bool = False
    """Run every stage on CPU with the tiny preset, producing the same files; stages that need CUDA are skipped."""
    stages: Optional[list[str]] = None
    """Run only these stages (by name); default: all. The others are ``skipped: not selected``."""
    root: Optional[str] = None
    """The repository checkout whose configs/ and tests/ the stages use; default: the one holding this package,
    else the current directory."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every process a stage starts, e.g. ``{NCCL_DEBUG: WARN}``."""
    resume: bool = False
    """Keep the stages of ``--out``'s stages.json that are ``ok`` and run the rest; without it, an ``--out`` that
    holds a study is refused."""
    archive: Optional[str] = None
    """Write a ``.tar.gz`` of what is worth committing (no weights, no raw traces, at most 16 MiB) here when the
    call ends, finished or cut off."""
    commit: Optional[str] = None
    """The git commit of the code, for a copy without ``.git``; default: ``git rev-parse HEAD``, else
    ``$LIGHTNING_DDP_COMMIT``."""

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("`--out` is missing; give the directory for the study's files, e.g. `--out gpu_study`")
        if not self.budget_min > 0:
            raise ValueError(f"`--budget_min` must be > 0 minutes, got {self.budget_min}; e.g. `--budget_min 9`")
        if self.stages is not None:
            unknown = [s for s in self.stages if s not in STAGE_NAMES]
            if unknown:
                raise ValueError(f"unknown stage {unknown[0]!r} in `--stages`; choose from {', '.join(STAGE_NAMES)}")
            if not self.stages:
                raise ValueError(f"`--stages` is empty; list one or more of {', '.join(STAGE_NAMES)}, or leave it out")
        if self.archive is not None and not self.archive.endswith(".tar.gz"):
            raise ValueError(f"`--archive` must name a .tar.gz file, got {self.archive!r}; "
                             "e.g. `--archive study.tar.gz`")
        if self.commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise ValueError(f"`--commit` must be a git commit hash (7-40 hex digits), got {self.commit!r}; e.g. "
                             "`--commit $(git rev-parse HEAD)` where the checkout has .git")


def scale_of(config: GPUStudyConfig) -> Scale:
    """``DRY_RUN_SCALE`` for a CPU dry run, else ``GPU_SCALE`` (a function: jsonargparse would offer a method of
    the config class as a subcommand)."""
    return DRY_RUN_SCALE if config.cpu_dry_run else GPU_SCALE
