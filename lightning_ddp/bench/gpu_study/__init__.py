"""``python -m lightning_ddp.bench.gpu_study --out DIR --budget_min 9``: its command line (``GPUStudyConfig``) and
the sizes of its work on a GPU (``GPU_SCALE``) and in the CPU rehearsal (``DRY_RUN_SCALE``); docs/gpu.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Scale:
    """The sizes of every stage's work: per stage, the keyword arguments of its fits (``stages.fit_args``)."""

    device: str  # cuda, or cpu for the dry run
    backend: str  # of one rank per device: nccl on a GPU, gloo on CPU
    precision: str  # of the stages' fits (stage compute measures both bf16-mixed and 32-true)
    compute: Mapping[str, Any]  # max_batch caps the memory pre-flight's batch
    strategies: Mapping[str, Any]  # warm-up steps are left out of the medians
    traces: Mapping[str, Any]  # 2 ranks; the last steps - warmup steps are traced
    profile: Mapping[str, Any]  # stage ready_times
    overhead: Mapping[str, Any]  # stage timer_overhead
    overhead_repeats: int  # off/on pairs
    sweep_config: str  # stage one_gpu_pair's short sweep, relative to the checkout


GPU_SCALE = Scale(
    device="cuda", backend="nccl", precision="bf16-mixed",
    compute=dict(preset="xl", seq_len=512, max_batch=256, steps=8, warmup=3),
    strategies=dict(preset="medium", batch=8, seq_len=512, steps=20, warmup=5),
    traces=dict(preset="small", batch=4, seq_len=256, steps=9, warmup=6),
    profile=dict(preset="xl", batch=4, seq_len=512, steps=12, warmup=3),  # the published 2-GPU xl runs
    overhead=dict(preset="small", batch=8, seq_len=512, steps=25, warmup=5), overhead_repeats=2,  # 6 fits, ~2 min
    sweep_config="configs/bench/gpu_study.yaml",
)
"""One H100 (80 GB) or H200 (141 GB): about 17 minutes of stages, two calls of ``--budget_min 9``."""

DRY_RUN_SCALE = Scale(
    device="cpu", backend="gloo", precision="32-true",  # bf16 autocast on CPU is several times slower than fp32
    compute=dict(preset="tiny", seq_len=32, max_batch=2, steps=2, warmup=1),
    strategies=dict(preset="tiny", batch=2, seq_len=32, steps=4, warmup=1),
    traces=dict(preset="tiny", batch=4, seq_len=32, steps=9, warmup=6),
    profile=dict(preset="tiny", batch=2, seq_len=32, steps=5, warmup=3),
    overhead=dict(preset="tiny", batch=2, seq_len=32, steps=6, warmup=2), overhead_repeats=1,
    sweep_config="configs/bench/gpu_study_cpu.yaml",  # the same sweep shrunk: 2 cells on CPU
)
"""The same stages on CPU with the tiny preset: every code path but the CUDA lines, in minutes on 2 cores."""


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
        if not self.out:
            raise ValueError("`--out` is missing; give the directory for the study's files, e.g. `--out gpu_study`")
        if not self.budget_min > 0:
            raise ValueError(f"`--budget_min` must be > 0 minutes, got {self.budget_min}; e.g. `--budget_min 9`")
        if self.archive is not None and not self.archive.endswith(".tar.gz"):
            raise ValueError(f"`--archive` must name a .tar.gz file, got {self.archive!r}; "
                             "e.g. `--archive study.tar.gz`")
        if self.commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise ValueError(f"`--commit` must be a git commit hash (7-40 hex digits), got {self.commit!r}; e.g. "
                             "`--commit $(git rev-parse HEAD)` where the checkout has .git")
