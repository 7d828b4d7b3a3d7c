"""``zero1_ddp``: optimizer-state sharding (ZeRO stage 1) over our engines (see ``lightning_ddp.sync.zero1``).

What it adds to ``ShardedOptimizerStrategy`` (``lightning_ddp.strategies.sharded``: the sharded optimizers, their
recorder, clipping and checkpoints, shared with ``zero2_ddp``):

- ``make_engine``: with ``schedule: allreduce_broadcast`` the algorithm named by ``grad_sync`` (any entry of
  ``lightning_ddp.sync.registry``) all-reduces the gradients as usual; with ``schedule: reduce_scatter`` a
  ``DeferredGradSync`` leaves them local, because the optimizer reduce-scatters them in ``step()``.
- ``shard``: each optimizer of ``configure_optimizers`` becomes a ``ShardedOptimizer.from_optimizer`` of it with the
  strategy's schedule.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import catalogue
from lightning_ddp.strategies.sharded import ShardedOptimizerStrategy, check_no_fp16
from lightning_ddp.sync import GradSyncEngine
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.zero1 import (
    CollectiveImpl,
    DeferredGradSync,
    Schedule,
    ShardedOptimizer,
    check_collective_impl,
    check_schedule,
)


class ZeRO1DDPStrategy(ShardedOptimizerStrategy):
    """Shard the optimizer state over the ranks (ZeRO-1); ``configure_optimizers`` stays unchanged.

    Select it with ``trainer.strategy: zero1_ddp`` (reduce-scatter schedule), or configure it::

        strategy:
          class_path: lightning_ddp.strategies.ZeRO1DDPStrategy
          init_args: {schedule: allreduce_broadcast, grad_sync: bucketed_ddp, bucket_size_mb: 25}

    Args:
        schedule: ``reduce_scatter`` (ZeRO-1: reduce-scatter the gradients in ``optimizer.step()``, all-gather
            the parameters; DDP's communication volume) or ``allreduce_broadcast`` (the ``grad_sync`` engine
            all-reduces in backward, owners broadcast their parameters; 1.5x the volume, but the all-reduce
            overlaps backward). Gradient clipping (``norm`` or ``value``) works under both: the optimizer clips
            the owned, averaged gradients by the global norm in ``step()``.
        grad_sync: The algorithm that all-reduces gradients under ``allreduce_broadcast``: a catalogue engine
            (``naive_ddp``, ``flat_ddp``, ``overlap_ddp``, ``bucketed_ddp``, ...). Ignored by ``reduce_scatter``.
        bucket_size_mb: Bucket cap in MiB of a ``grad_sync`` algorithm with buckets; ``null`` for one bucket.
        collectives: ``auto`` (per-owner reduce/broadcast on gloo, native reduce-scatter/all-gather otherwise),
            ``native`` or ``per_owner``; see ``lightning_ddp.sync.zero1``.
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method), ``engine_settings``
            included: the ``grad_sync`` engine's own settings (e.g. ``{rank: 4}`` for ``bucketed_powersgd_ddp``), checked
            against that algorithm; ignored by ``reduce_scatter``, like ``grad_sync``.
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
        return "zero1_ddp"

    @override
    def make_engine(self, module: nn.Module) -> GradSyncEngine:
        if self.schedule == "reduce_scatter":
            return DeferredGradSync(module)
        return super().make_engine(module)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "zero1_ddp" not in strategy_registry:
            strategy_registry.register("zero1_ddp", cls, description=(cls.__doc__ or "").strip().splitlines()[0])

    @override
    def check_supported(self, precision: str) -> None:
        if self.schedule == "reduce_scatter":
            check_no_fp16(precision, "`schedule: reduce_scatter`", "`--trainer.strategy.init_args.schedule "
                          "allreduce_broadcast` (gradients are averaged in backward, so every rank sees the same inf)")

    @override
    def shard(self, optimizer: Optimizer) -> Optimizer:
        if not isinstance(optimizer, ShardedOptimizer):
            optimizer = ShardedOptimizer.from_optimizer(optimizer, schedule=self.schedule, collectives=self.collectives)
        elif optimizer.schedule != self.schedule:  # sharded by the user: its schedule must match our engine
            raise ValueError(
                f"configure_optimizers returned a ShardedOptimizer with schedule={optimizer.schedule!r}, but the "
                f"strategy runs schedule={self.schedule!r}; return a plain optimizer (the strategy shards it) or set "
                f"`--trainer.strategy.init_args.schedule {optimizer.schedule}`."
            )
        return optimizer

