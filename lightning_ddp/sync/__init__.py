"""Pure-PyTorch gradient synchronisation: one algorithm per file over a small shared base.

=================  =========================================================================
``NaiveDDP``       after backward, one blocking all-reduce per gradient tensor
``FlatDDP``        after backward, one all-reduce of all gradients flattened into one buffer
``OverlapDDP``     during backward, an async all-reduce per gradient as soon as it is ready
``BucketedDDP``    during backward, an async all-reduce per size-capped bucket as it fills
=================  =========================================================================

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

__all__ = [
    "BucketedDDP",
    "Collective",
    "DataParallel",
    "FlatDDP",
    "NaiveDDP",
    "OverlapDDP",
    "StepClock",
    "SyncRecord",
    "assign_buckets",
    "broadcast_module_states",
]
