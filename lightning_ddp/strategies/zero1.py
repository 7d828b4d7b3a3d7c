"""``zero1_ddp``: optimizer-state sharding (ZeRO stage 1) over our engines.

The schedules: ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import catalogue
from lightning_ddp.strategies.base import entry_of
from lightning_ddp.strategies.sharded import ShardedOptimizerStrategy, check_no_fp16
from lightning_ddp.sync import GradSyncEngine
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.zero1 import DeferredGradSync
from lightning_ddp.sync.sharding.optimizer import (
    CollectiveImpl,
    Schedule,
    ShardedOptimizer,
    check_collective_impl,
    check_schedule,
)


class ZeRO1DDPStrategy(ShardedOptimizerStrategy):
    """Shard the optimizer state over the ranks (ZeRO-1); ``configure_optimizers`` stays unchanged.

    Args:
        schedule: ``reduce_scatter`` (in ``optimizer.step()``) or ``allreduce_broadcast`` (``grad_sync`` in backward).
        grad_sync: The catalogue engine that all-reduces under ``allreduce_broadcast``, e.g. ``bucketed_ddp``.
        bucket_size_mb: Bucket cap in MiB of a ``grad_sync`` engine with buckets; ``null`` for one bucket.
        collectives: ``auto`` (per owner on gloo, native otherwise), ``native`` or ``per_owner``.
        **kwargs: The arguments of ``GradSyncStrategy``; ``engine_settings`` go to the ``grad_sync`` engine.
    """

    def __init__(
        self,
        schedule: Schedule = "reduce_scatter",
        grad_sync: str = catalogue.DEFAULT_ENGINE,
        bucket_size_mb: float | None = 25.0,
        collectives: CollectiveImpl = "auto",
        **kwargs: Any,
    ) -> None:
        # Fail when the config is read, not after the processes have started.
        check_schedule(schedule)
        check_collective_impl(collectives)
        check_bucket_size(bucket_size_mb)
        try:
            has_buckets = catalogue.get(grad_sync).has_bucket_size
        except ValueError as error:
            raise ValueError(f"grad_sync: {error}") from None
        super().__init__(algorithm=grad_sync, bucket_size_mb=bucket_size_mb if has_buckets else "default", **kwargs)
        self.schedule = schedule
        self.grad_sync = grad_sync
        self.collectives = collectives

    @property
    @override
    def strategy_name(self) -> str:
        return entry_of(type(self)).name

    @override
    def make_engine(self, module: nn.Module) -> GradSyncEngine:
        if self.schedule == "reduce_scatter":
            return DeferredGradSync(module)
        return super().make_engine(module)

    @override
    def check_supported(self, precision: str) -> None:
        if self.schedule == "reduce_scatter":
            check_no_fp16(precision, "`schedule: reduce_scatter`", "`--trainer.strategy.init_args.schedule "
                          "allreduce_broadcast` (gradients are averaged in backward, so every rank sees the same inf)")

    @override
    def shard(self, optimizer: Optimizer) -> Optimizer:
        if not isinstance(optimizer, ShardedOptimizer):
            optimizer = ShardedOptimizer.from_optimizer(
                optimizer, schedule=self.schedule, collectives=self.collectives
            )
        elif optimizer.schedule != self.schedule:  # sharded by the user: its schedule must match our engine
            raise ValueError(
                f"configure_optimizers returned a ShardedOptimizer with schedule={optimizer.schedule!r}, but the "
                f"strategy runs schedule={self.schedule!r}; return a plain optimizer (the strategy shards it) or set "
                f"`--trainer.strategy.init_args.schedule {optimizer.schedule}`."
            )
        return optimizer

