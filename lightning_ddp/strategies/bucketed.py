"""``bucketed_ddp``: during backward, an async all-reduce per size-capped bucket (see ``lightning_ddp.sync.bucketed``)."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

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
        bucket_size_mb: Bucket cap in MiB (2**20 bytes); ``null`` for one bucket holding every gradient; ``auto`` to
            predict the best cap from a short all-reduce microbenchmark when training starts (logged on rank 0).
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method).
    """

    strategy_name = "bucketed_ddp"

    def __init__(self, bucket_size_mb: float | Literal["auto"] | None = 25.0, **kwargs: Any) -> None:
        check_bucket_size(bucket_size_mb)  # fail when the config is read, not after the processes start
        super().__init__(**kwargs)
        self.bucket_size_mb = bucket_size_mb

    @override
    def make_container(self, module: nn.Module) -> BucketedDDP:
        container = BucketedDDP(module, bucket_size_mb=self.bucket_size_mb)
        prediction = container.bucket_prediction
        if prediction is not None:
            rank_zero_info(
                f"bucket_size_mb=auto: {prediction.bucket_size_mb:.3g} MiB ({len(container.buckets)} buckets) from an "
                f"all-reduce fit of {prediction.overhead_s * 1e6:.0f} us per call and "
                f"{prediction.bandwidth_Bps / 1e9:.2f} GB/s over {prediction.grad_bytes / 2**20:.1f} MiB of gradients"
            )
        return container
