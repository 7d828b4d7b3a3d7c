"""What a GPU study run is: the command line (``GPUStudyConfig``) and the sizes of its work (``Scale``).

The command line is small on purpose (``--out DIR --resume true``): the sizes that make the whole study fit two
9-minute calls on one H100 or H200 are fixed here, in ``GPU_SCALE``, and ``DRY_RUN_SCALE`` shrinks every one of them to
the tiny preset on CPU, so ``--cpu_dry_run true`` runs every stage's code in a few minutes on a 2-core machine.
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
    """The sizes of every stage's work: models, batches, steps, which strategies."""

    device: str
    """``cuda`` or ``cpu`` (the dry run)."""
    precision: str
    """The training precision of the stages' fits (stage compute measures both bf16-mixed and 32-true)."""
    compute_preset: str
    """Stage compute: the preset whose step time, MFU and memory are measured (the study's xl)."""
    compute_seq_len: int
    """Stage compute: tokens per sequence."""
    compute_max_batch: int
    """Stage compute: the largest batch ``largest_batch`` may propose."""
    compute_steps: int
    """Stage compute: measured steps per batch (after ``compute_warmup``)."""
    compute_warmup: int
    """Stage compute: steps run first and left out (allocator and kernel selection warm-up)."""
    strategies_preset: str
    """Stage strategies: the preset every strategy trains at world size 1."""
    strategies_batch: int
    """Stage strategies: per-rank batch (sequences)."""
    strategies_seq_len: int
    """Stage strategies: tokens per sequence."""
    strategies_steps: int
    """Stage strategies: optimizer steps per strategy, of which ``strategies_warmup`` are left out."""
    strategies_warmup: int
    """Stage strategies: warm-up steps left out of the medians."""
    equivalence_preset: str
    """Stage one_gpu_pair: the preset of the 2-rank-versus-1-process equivalence fits."""
    equivalence_steps: int
    """Stage one_gpu_pair: optimizer steps of each equivalence fit."""
    sweep_config: str
    """Stage one_gpu_pair: the sweep config (relative to the repository root) of the short sweep."""
    sweep_strategies: tuple[str, ...]
    """Stage one_gpu_pair: ``grid.strategies`` of the short sweep (the reference and ddp are always added)."""
    trace_preset: str
    """Stage traces: the preset of the naive and overlap traces (2 gloo ranks on the one device)."""
    profile_preset: str
    """Stage ready_times: the preset whose backward is profiled (the study's xl)."""
    profile_batch: int
    """Stage ready_times: per-rank batch (the published 2-GPU xl runs' batch 4)."""
    profile_seq_len: int
    """Stage ready_times: tokens per sequence (the published runs' context 512)."""
    profile_steps: int
    """Stage ready_times: optimizer steps (the CommTimer's warm-up is 3 of them)."""
    overhead_preset: str
    """Stage timer_overhead: the preset of the timer on/off fits."""
    overhead_steps: int
    """Stage timer_overhead: optimizer steps per fit."""
    overhead_warmup: int
    """Stage timer_overhead: steps per fit left out of the median."""
    overhead_repeats: int
    """Stage timer_overhead: off/on pairs."""


GPU_SCALE = Scale(
    device="cuda", precision="bf16-mixed",
    compute_preset="xl", compute_seq_len=512, compute_max_batch=256, compute_steps=8, compute_warmup=3,
    strategies_preset="medium", strategies_batch=8, strategies_seq_len=512, strategies_steps=20, strategies_warmup=5,
    equivalence_preset="tiny", equivalence_steps=3,  # the steps the tolerances were calibrated at
    sweep_config="configs/bench/gpu_study.yaml",
    sweep_strategies=("naive", "flat", "overlap", "bucketed", "bucketed_bf16", "ddp"),
    trace_preset="small",
    profile_preset="xl", profile_batch=4, profile_seq_len=512, profile_steps=12,
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
    """Directory of every output (required): stages.json (rewritten after every stage), results.md, each stage's
    files."""
    budget_min: float = 9.0
    """Minutes this call may take, counted from its start (9: one 10-minute command with a minute to spare for
    installing packages and the archive). Before each stage its estimate is compared with what is left: a stage that
    cannot finish in time is skipped (``skipped: budget``) for a later ``--resume true`` call, and no stage's
    processes run past the budget."""
    cpu_dry_run: bool = False
    """Run every stage on CPU with the tiny preset (minutes on a laptop), producing the same files; stages that
    need CUDA are ``skipped: no CUDA``. Rehearse here what a GPU session will run."""
    stages: Optional[list[str]] = None
    """Run only these stages (by name, in the study's order); default: all. The others are ``skipped: not
    selected``."""
    root: Optional[str] = None
    """The repository checkout whose configs/ and tests/ the stages use; default: the one this package is in,
    else the current directory."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every process a stage starts, e.g. ``{NCCL_DEBUG: WARN}``."""
    resume: bool = False
    """Keep every stage of ``--out``'s stages.json that is already ``ok`` (its row and files unchanged) and run the
    rest: the study in several calls of a few minutes each. Without it, an ``--out`` that holds a study is refused."""
    archive: Optional[str] = None
    """Write one ``.tar.gz`` of what is worth committing (stages.json, results.md, the JSON/CSV results and the
    pictures; no weights, no raw traces, at most 16 MiB) here when the call ends, finished or cut off."""
    commit: Optional[str] = None
    """The git commit of the code, for a copy of the repository without ``.git`` (as a GPU machine receives it);
    default: ``git rev-parse HEAD``, else the environment variable ``LIGHTNING_DDP_COMMIT``."""

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
                raise ValueError(f"`--stages` is empty; list at least one of {', '.join(STAGE_NAMES)}, or leave it out")
        if self.archive is not None and not self.archive.endswith(".tar.gz"):
            raise ValueError(f"`--archive` must name a .tar.gz file, got {self.archive!r}; "
                             "e.g. `--archive study.tar.gz`")
        if self.commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise ValueError(f"`--commit` must be a git commit hash (7-40 hex digits), got {self.commit!r}; e.g. "
                             "`--commit $(git rev-parse HEAD)` where the checkout has .git")


def scale_of(config: GPUStudyConfig) -> Scale:
    """The sizes of ``config``'s work: ``DRY_RUN_SCALE`` for a CPU dry run, else ``GPU_SCALE``.

    A function, not a method: jsonargparse would offer a method of the config class as a subcommand.
    """
    return DRY_RUN_SCALE if config.cpu_dry_run else GPU_SCALE
