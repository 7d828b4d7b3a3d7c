"""Pure-PyTorch gradient synchronisation: one algorithm per file over a small shared base.

=================  =========================================================================
``NaiveDDP``       after backward, one blocking all-reduce per gradient tensor
``FlatDDP``        after backward, one all-reduce of all gradients flattened into one buffer
``OverlapDDP``     during backward, an async all-reduce per gradient as soon as it is ready
``BucketedDDP``    during backward, an async all-reduce per size-capped bucket as it fills
=================  =========================================================================

``ShardedOptimizer`` (``zero1``) shards the optimizer state over the ranks (ZeRO stage 1) on top of an engine,
or, with ``schedule="reduce_scatter"``, of ``DeferredGradSync``, a container that leaves gradients local.

Each is an ``nn.Module`` container with the conventional interface (see ``base``) and records its
communication per step in a ``SyncRecord`` (see ``record``). To add an engine: subclass ``DataParallel``,
implement ``_synchronize`` (and ``_on_grad_ready`` with ``uses_grad_hooks = True`` to act during backward),
then add a thin strategy in ``lightning_ddp.strategies``.
"""

from lightning_ddp.sync.base import DataParallel, broadcast_module_states
from lightning_ddp.sync.bucketed import BucketedDDP, assign_buckets
from lightning_ddp.sync.flat import FlatDDP
from lightning_ddp.sync.naive import NaiveDDP
from lightning_ddp.sync.overlap import OverlapDDP
from lightning_ddp.sync.record import Collective, StepClock, SyncRecord
from lightning_ddp.sync.zero1 import DeferredGradSync, ShardedOptimizer, assign_owners

__all__ = [
    "BucketedDDP",
    "Collective",
    "DataParallel",
    "DeferredGradSync",
    "FlatDDP",
    "NaiveDDP",
    "OverlapDDP",
    "ShardedOptimizer",
    "StepClock",
    "SyncRecord",
    "assign_buckets",
    "assign_owners",
    "broadcast_module_states",
]
