"""Benchmarks: ``python -m lightning_ddp.bench --config configs/bench/cpu.yaml`` runs the step-time sweep.

==================  =========================================================================================
module              what it does
==================  =========================================================================================
``config``          the sweep's configuration: one dataclass per concern (grid, workload, run, output)
``grid``            cells from the config, stable cell ids, the command and environment of each process
``runner``          runs one cell repeat in its own processes; ok / oom / failed / timeout and the reason
``load``            the load guard: waits for idle CPUs (/proc/stat) before each repeat, records how busy they were
``stats``           pooled medians, hierarchical-bootstrap intervals, ratios, verdicts (pure, numpy)
``results``         the files: repeats.csv and steps.csv (raw), results.csv (one row per cell), profiles.json
``analysis``        per group: the best bucket size chosen out of sample, the goals with intervals and verdicts
``report``          results.md: the tables with intervals and the analysis, rendered
``plots``           PNG figures with error bars (matplotlib Agg)
``sweep``           the orchestration: interleaved repeats, resume, progress, environment.json, the prediction
``allreduce``       the all-reduce microbenchmark job behind the prediction
``memory``          per-rank memory with and without ZeRO-1 (``python -m lightning_ddp.bench.memory``)
``memory_report``   the memory benchmark's summary per mode and its results.md
``timer_overhead``  what the CommTimer costs (``python -m lightning_ddp.bench.timer_overhead``)
``gpu_study``       the whole GPU study in one command, in stages under a time budget
                    (``python -m lightning_ddp.bench.gpu_study --out DIR``; ``--cpu_dry_run true`` rehearses it)
==================  =========================================================================================

Importing this package is cheap: the modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SweepConfig", "expand_grid", "run_sweep"]

_LAZY = {
    "SweepConfig": "lightning_ddp.bench.config",
    "expand_grid": "lightning_ddp.bench.grid",
    "run_sweep": "lightning_ddp.bench.sweep",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_ddp.bench' has no attribute {name!r}")
