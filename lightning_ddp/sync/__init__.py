"""Pure-PyTorch gradient synchronisation: one algorithm per file over a small shared base. No Lightning here.

=================  =========================================================================
``NaiveDDP``       after backward, one blocking all-reduce per gradient tensor
``FlatDDP``        after backward, one all-reduce of all gradients flattened into one buffer
``OverlapDDP``     during backward, an async all-reduce per gradient as soon as it is ready
``BucketedDDP``    during backward, an async all-reduce per size-capped bucket as it fills
=================  =========================================================================

``ShardedOptimizer`` (``zero1``) shards the optimizer state over the ranks (ZeRO stage 1) on top of an engine,
or, with ``schedule="reduce_scatter"``, of ``DeferredGradSync``, a container that leaves gradients local.

The parts every engine shares:

=================  =========================================================================
``base``           ``DataParallel``: wrapping, the rank-0 broadcast, ``no_sync``, the hook plumbing
``comm``           ``Communicator``: every collective, async, recorded and profiled in one place
``buffers``        flat buffers (pack, unpack) and the gradient-presence agreement
``reduce``         how a bucket is averaged (the bucketed engine's swappable step, torch DDP's comm hook)
``record``         ``Recorder``: what a step communicated, only when someone measures
``registry``       the list of algorithms (name -> engine, capabilities) everything else reads
``ranges``         the names of the profiler ranges the engines open
``bucket_model``   predicting the best bucket size from an all-reduce microbenchmark (``auto``)
``gather``         every rank's state for a checkpoint (ZeRO-1's optimizer shards, an engine's own state)
=================  =========================================================================

To add an algorithm: see ``lightning_ddp.sync.registry``. The names below load on first use, so reading the
registry or the range names costs no torch import.
"""

from __future__ import annotations


from lightning_ddp._lazy import lazy_exports

_HOMES = {
    "DataParallel": "lightning_ddp.sync.base",
    "broadcast_module_states": "lightning_ddp.sync.base",
    "BucketedDDP": "lightning_ddp.sync.bucketed",
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
    "ALGORITHMS": "lightning_ddp.sync.registry",
    "Algorithm": "lightning_ddp.sync.registry",
    "get_algorithm": "lightning_ddp.sync.registry",
    "register_algorithm": "lightning_ddp.sync.registry",
    "DeferredGradSync": "lightning_ddp.sync.zero1",
    "ShardedOptimizer": "lightning_ddp.sync.zero1",
    "assign_owners": "lightning_ddp.sync.zero1",
}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
