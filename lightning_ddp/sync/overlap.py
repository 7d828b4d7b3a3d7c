"""Overlap DDP: an async all-reduce per parameter, launched from its gradient hook during backward; exactly
``BucketedDDP`` with one parameter per bucket, and implemented as such (in place, no packing copy).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.bucketed import BucketedDDP
from lightning_ddp.sync.memory_model import MiB


class OverlapDDP(BucketedDDP):
    """All-reduce each gradient asynchronously as soon as backward has produced it."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        # A cap of 1 byte puts every parameter alone in its bucket (a parameter larger than the cap gets its own).
        super().__init__(module, bucket_size_mb=1 / MiB, process_group=process_group)
