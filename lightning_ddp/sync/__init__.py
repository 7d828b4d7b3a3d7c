"""Pure-PyTorch gradient synchronisation, no Lightning: one engine (``GradSyncEngine``) per file, each listed in
``lightning_ddp.catalogue``; ``docs/algorithms.md`` says what each does and how to add one. Names load on first use.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "base": ("GradSyncEngine", "broadcast_module_states"),
    "bucketed": ("AllReduceMean", "BucketLayout", "BucketReduce", "BucketedDDP", "Reduction"),
    "bucketed_bf16": ("BucketedBF16DDP",),
    "bucketed_powersgd": ("BucketedPowerSGDDDP",),
    "assignment": ("assign_buckets", "assign_owners"),
    "comm": ("Communicator",),
    "flat": ("FlatDDP",),
    "naive": ("NaiveDDP",),
    "overlap": ("OverlapDDP",),
    "record": ("Collective", "Recorder", "StepClock", "SyncRecord"),
    "recording_group": ("RecordingProcessGroup", "record_process_groups", "stop_recording_process_groups"),
    "sharding": ("ShardedOptimizer",),
    "zero1": ("DeferredGradSync",),
    "zero2": ("ZeRO2DDP",),
}
_HOMES = {name: f"{__name__}.{module}" for module, names in _NAMES.items() for name in names}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    """PEP 562: a name of ``_HOMES`` imported on first use, so importing the package is cheap."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
