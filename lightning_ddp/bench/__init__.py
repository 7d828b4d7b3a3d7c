"""The study: benchmarks as configs of one pipeline (``python -m lightning_ddp.bench --config configs/bench/cpu.yaml``
runs the step-time sweep). ``launch`` starts every fit; docs/benchmarks.md describes each benchmark and its files.
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
