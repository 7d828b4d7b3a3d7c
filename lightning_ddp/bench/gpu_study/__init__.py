"""The whole GPU study in one command: ``python -m lightning_ddp.bench.gpu_study --out DIR --budget_min 9``.

Ordered stages (``stages.STAGES``), each writing its files into ``DIR`` as soon as it ends, under a time budget
per call (``study.run_study``); ``--resume true`` finishes the study in several calls, ``--cpu_dry_run true``
rehearses every stage on CPU. docs/gpu.md has the stages, the budget rule and how to read the numbers.
"""

from __future__ import annotations

from lightning_ddp.bench.gpu_study.config import DRY_RUN_SCALE, GPU_SCALE, GPUStudyConfig, Scale

__all__ = ["DRY_RUN_SCALE", "GPU_SCALE", "GPUStudyConfig", "Scale"]
