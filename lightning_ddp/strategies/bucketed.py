"""``bucketed_ddp``: during backward, an async all-reduce per size-capped bucket (see ``lightning_ddp.sync.bucketed``)."""

from __future__ import annotations

from typing import Any

from torch import nn
from typing_extensions import override

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync.bucketed import BucketedDDP, check_bucket_size


class BucketedDDPStrategy(GradSyncStrategy):
    """During backward, an async all-reduce per size-capped bucket of gradients as it fills.

    Select it with ``trainer.strategy: bucketed_ddp`` (25 MiB buckets), or set the size::

        strategy:
          class_path: lightning_ddp.strategies.BucketedDDPStrategy
          init_args: {bucket_size_mb: 100}

    Args:
        bucket_size_mb: Bucket cap in MiB (2**20 bytes); ``null`` for one bucket holding every gradient.
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method).
    """

    strategy_name = "bucketed_ddp"

    def __init__(self, bucket_size_mb: float | None = 25.0, **kwargs: Any) -> None:
        check_bucket_size(bucket_size_mb)  # fail when the config is read, not after the processes start
        super().__init__(**kwargs)
        self.bucket_size_mb = bucket_size_mb

    @override
    def make_container(self, module: nn.Module) -> BucketedDDP:
        return BucketedDDP(module, bucket_size_mb=self.bucket_size_mb)
