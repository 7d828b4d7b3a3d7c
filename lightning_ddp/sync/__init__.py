"""Pure-PyTorch gradient synchronisation, no Lightning: one engine (``GradSyncEngine``) per file, each listed in
``lightning_ddp.catalogue``; ``docs/algorithms.md`` says what each does and how to add one. Names load on first use.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "GradSyncEngine": "lightning_ddp.sync.base",
    "broadcast_module_states": "lightning_ddp.sync.base",
    "BucketedDDP": "lightning_ddp.sync.bucketed",
    "BucketedBF16DDP": "lightning_ddp.sync.bucketed_bf16",
    "BucketedPowerSGDDDP": "lightning_ddp.sync.bucketed_powersgd",
    "assign_buckets": "lightning_ddp.sync.assignment",
    "Communicator": "lightning_ddp.sync.comm",
    "Pending": "lightning_ddp.sync.comm",
    "FlatDDP": "lightning_ddp.sync.flat",
    "NaiveDDP": "lightning_ddp.sync.naive",
    "OverlapDDP": "lightning_ddp.sync.overlap",
    "Collective": "lightning_ddp.sync.record",
    "Recorder": "lightning_ddp.sync.record",
    "StepClock": "lightning_ddp.sync.record",
    "SyncRecord": "lightning_ddp.sync.record",
    "AllReduceMean": "lightning_ddp.sync.bucketed",
    "BucketLayout": "lightning_ddp.sync.bucketed",
    "BucketReduce": "lightning_ddp.sync.bucketed",
    "Reduction": "lightning_ddp.sync.bucketed",
    "DeferredGradSync": "lightning_ddp.sync.zero1",
    "ShardedOptimizer": "lightning_ddp.sync.sharding",
    "assign_owners": "lightning_ddp.sync.assignment",
    "ZeRO2DDP": "lightning_ddp.sync.zero2",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    """PEP 562: a name of ``_HOMES`` imported on first use, so importing the package is cheap."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
