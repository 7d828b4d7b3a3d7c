"""Pure-PyTorch gradient synchronisation: one algorithm per file over a small shared base. No Lightning here.

Each algorithm is an *engine*: the model wrapped for data-parallel training, a ``GradSyncEngine``. The catalogue
(``lightning_ddp.catalogue``) lists them; this table is checked against it (``tests/dist/test_registry.py``):

=====================  ========================  ======================================================================
algorithm              engine                    what it does
=====================  ========================  ======================================================================
``naive``              ``NaiveDDP``              after backward, one blocking all-reduce per gradient tensor
``flat``               ``FlatDDP``               after backward, one all-reduce of all gradients flattened into one buffer
``overlap``            ``OverlapDDP``            during backward, an async all-reduce per gradient as soon as it is ready
``bucketed``           ``BucketedDDP``           during backward, an async all-reduce per size-capped bucket as it fills
``bucketed_bf16``      ``BucketedBF16DDP``       bucketed, the buckets communicated in bf16: half the bytes, lossy
``bucketed_powersgd``  ``BucketedPowerSGDDDP``   bucketed, each large gradient matrix sent as low-rank PowerSGD factors
                                                 with error feedback: far fewer bytes, lossy
=====================  ========================  ======================================================================

``ShardedOptimizer`` (``zero1``) shards the optimizer state over the ranks (ZeRO stage 1) on top of an engine,
or, with ``schedule="reduce_scatter"``, of ``DeferredGradSync``, an engine that leaves gradients local.
``ZeRO2DDP`` (``zero2``, ZeRO stage 2) reduces gradient buckets to their owners during backward and keeps only the
owned gradients; a ``ShardedOptimizer`` with ``schedule="reduce_in_backward"`` steps them. Neither is a registry
algorithm: each needs its sharded optimizer (the ``zero1_ddp`` and ``zero2_ddp`` strategies build both).

The parts every engine shares:

=================  =========================================================================
``base``           ``GradSyncEngine``: wrapping, the rank-0 broadcast, ``no_sync``, the hook plumbing
``comm``           ``Communicator``: every collective, async, recorded and profiled in one place
``buffers``        flat buffers (pack, unpack) and the gradient-presence agreement
``reduce``         how a bucket is averaged (the bucketed engine's swappable step, torch DDP's comm hook)
``record``         ``Recorder``: what a step communicated, only when someone measures
``ranges``         the names of the profiler ranges the engines open
``bucket_model``   predicting the best bucket size from an all-reduce microbenchmark (``auto``)
``gather``         every rank's state for a checkpoint (ZeRO-1's optimizer shards, an engine's own state)
=================  =========================================================================

To add an algorithm: see ``docs/algorithms.md``. The names below load on first use.
"""

from __future__ import annotations


from lightning_ddp._lazy import lazy_exports

_HOMES = {
    "GradSyncEngine": "lightning_ddp.sync.base",
    "DataParallel": "lightning_ddp.sync.base",  # GradSyncEngine's old name (deprecated, warns)
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
    "AllReduceMean": "lightning_ddp.sync.reduce",
    "BucketLayout": "lightning_ddp.sync.reduce",
    "BucketReduce": "lightning_ddp.sync.reduce",
    "Reduction": "lightning_ddp.sync.reduce",
    "DeferredGradSync": "lightning_ddp.sync.zero1",
    "ShardedOptimizer": "lightning_ddp.sync.zero1",
    "assign_owners": "lightning_ddp.sync.zero1",
    "ZeRO2DDP": "lightning_ddp.sync.zero2",
}
__all__ = sorted(set(_HOMES) - {"DataParallel"})
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
