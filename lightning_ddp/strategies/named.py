"""One class per built-in algorithm, for the class paths users' YAML files name.

Each only fixes ``algorithm`` of ``GradSyncStrategy`` (and keeps the options that algorithm has), so that
``class_path: lightning_ddp.strategies.BucketedDDPStrategy`` with ``init_args: {bucket_size_mb: 100}`` keeps
working. A new algorithm needs no class here: ``trainer.strategy: <name>_ddp``, or ``GradSyncStrategy`` with
``init_args: {algorithm: <name>}``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from lightning_ddp.strategies.base import GradSyncStrategy


class NaiveDDPStrategy(GradSyncStrategy):
    """After backward, all-reduce every gradient tensor, one blocking call each (``naive_ddp``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(algorithm="naive_ddp", **kwargs)


class FlatDDPStrategy(GradSyncStrategy):
    """After backward, all-reduce all gradients flattened into one buffer (``flat_ddp``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(algorithm="flat_ddp", **kwargs)


class OverlapDDPStrategy(GradSyncStrategy):
    """During backward, an async all-reduce of each gradient as soon as it is ready (``overlap_ddp``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(algorithm="overlap_ddp", **kwargs)


class BucketedDDPStrategy(GradSyncStrategy):
    """During backward, an async all-reduce per size-capped bucket of gradients as it fills (``bucketed_ddp``).

    Args:
        bucket_size_mb: Bucket cap in MiB (2**20 bytes); ``null`` for one bucket holding every gradient; ``auto`` to
            predict the best cap from a short all-reduce microbenchmark when training starts (logged on rank 0).
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method).
    """

    def __init__(self, bucket_size_mb: Optional[Union[float, Literal["auto"]]] = 25.0, **kwargs: Any) -> None:
        super().__init__(algorithm="bucketed_ddp", bucket_size_mb=bucket_size_mb, **kwargs)
