"""``zero1_ddp``: optimizer-state sharding (ZeRO stage 1) over our engines (see ``lightning_ddp.sync.zero1``).

What it adds to ``GradSyncStrategy``:

- ``make_container``: with ``schedule: allreduce_broadcast`` the engine named by ``grad_sync`` all-reduces the
  gradients as usual; with ``schedule: reduce_scatter`` a ``DeferredGradSync`` leaves them local, because the
  optimizer reduce-scatters them in ``step()``.
- ``setup_optimizers``: after ``configure_optimizers`` (unchanged), each optimizer is replaced by a
  ``ShardedOptimizer.from_optimizer`` of it, which shares its parameter-group dicts, and every LR scheduler is
  re-pointed at the sharded optimizer. The optimizer records its collectives in the engine's per-step
  ``SyncRecord``, so the ``CommTimer`` accounts them.
- Checkpoints: ``ShardedOptimizer.state_dict()`` is a collective returning the consolidated state on every rank;
  Lightning calls it on every rank in ``dump_checkpoint`` and writes rank 0's, and loads the file on every rank
  on resume, where each rank keeps its shard. The file equals an unsharded run's (resumable under ``ddp`` too).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import _MockOptimizer
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync import BucketedDDP, DataParallel, FlatDDP, NaiveDDP, OverlapDDP
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.zero1 import (
    CollectiveImpl,
    DeferredGradSync,
    Schedule,
    ShardedOptimizer,
    check_collective_impl,
    check_schedule,
)

GradSync = Literal["naive", "flat", "overlap", "bucketed"]
GRAD_SYNCS: tuple[str, ...] = ("naive", "flat", "overlap", "bucketed")


class ZeRO1DDPStrategy(GradSyncStrategy):
    """Shard the optimizer state over the ranks (ZeRO-1); ``configure_optimizers`` stays unchanged.

    Select it with ``trainer.strategy: zero1_ddp`` (reduce-scatter schedule), or configure it::

        strategy:
          class_path: lightning_ddp.strategies.ZeRO1DDPStrategy
          init_args: {schedule: allreduce_broadcast, grad_sync: bucketed, bucket_size_mb: 25}

    Args:
        schedule: ``reduce_scatter`` (ZeRO-1: reduce-scatter the gradients in ``optimizer.step()``, all-gather
            the parameters; DDP's communication volume) or ``allreduce_broadcast`` (the ``grad_sync`` engine
            all-reduces in backward, owners broadcast their parameters; 1.5x the volume, but the all-reduce
            overlaps backward and gradient clipping works).
        grad_sync: The engine that all-reduces gradients under ``allreduce_broadcast``: ``naive``, ``flat``,
            ``overlap`` or ``bucketed``. Ignored by ``reduce_scatter``.
        bucket_size_mb: Bucket cap of the ``bucketed`` engine in MiB; ``null`` for one bucket.
        collectives: ``auto`` (per-owner reduce/broadcast on gloo, native reduce-scatter/all-gather otherwise),
            ``native`` or ``per_owner``; see ``lightning_ddp.sync.zero1``.
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method).
    """

    strategy_name = "zero1_ddp"

    def __init__(
        self,
        schedule: Schedule = "reduce_scatter",
        grad_sync: GradSync = "bucketed",
        bucket_size_mb: float | None = 25.0,
        collectives: CollectiveImpl = "auto",
        **kwargs: Any,
    ) -> None:
        # Fail when the config is read, not after the processes have started.
        check_schedule(schedule)
        check_collective_impl(collectives)
        check_bucket_size(bucket_size_mb)
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync={grad_sync!r} is not supported; choose one of: {', '.join(GRAD_SYNCS)}.")
        super().__init__(**kwargs)
        self.schedule = schedule
        self.grad_sync = grad_sync
        self.bucket_size_mb = bucket_size_mb
        self.collectives = collectives

    @override
    def make_container(self, module: nn.Module) -> DataParallel:
        if self.schedule == "reduce_scatter":
            return DeferredGradSync(module)
        if self.grad_sync == "naive":
            return NaiveDDP(module)
        if self.grad_sync == "flat":
            return FlatDDP(module)
        if self.grad_sync == "overlap":
            return OverlapDDP(module)
        return BucketedDDP(module, bucket_size_mb=self.bucket_size_mb)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.schedule == "reduce_scatter" and trainer.gradient_clip_val:
            raise ValueError(
                "Gradient clipping needs gradients averaged over the ranks, but `schedule: reduce_scatter` averages "
                "them inside optimizer.step(), after Lightning clips. Use "
                "`--trainer.strategy.init_args.schedule allreduce_broadcast` or drop `gradient_clip_val`."
            )
        super().setup(trainer)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers, as written by the user
        sharded = [self._shard(optimizer) for optimizer in self.optimizers]
        for config in self.lr_scheduler_configs:
            for original, replacement in zip(self.optimizers, sharded):
                if config.scheduler.optimizer is original and replacement is not original:
                    _repoint_scheduler(config.scheduler, replacement)
        self.optimizers = sharded

    def _shard(self, optimizer: Optimizer) -> Optimizer:
        if isinstance(optimizer, _MockOptimizer):  # configure_optimizers returned None: nothing to shard
            return optimizer
        if not isinstance(optimizer, ShardedOptimizer):
            optimizer = ShardedOptimizer.from_optimizer(optimizer, schedule=self.schedule, collectives=self.collectives)
        elif optimizer.schedule != self.schedule:  # sharded by the user: its schedule must match our container
            raise ValueError(
                f"configure_optimizers returned a ShardedOptimizer with schedule={optimizer.schedule!r}, but the "
                f"strategy runs schedule={self.schedule!r}; return a plain optimizer (the strategy shards it) or set "
                f"`--trainer.strategy.init_args.schedule {optimizer.schedule}`."
            )
        if self.container is not None:
            optimizer.attach_record(self.container)
        return optimizer


def _repoint_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Make ``scheduler`` drive ``optimizer`` (whose param-group dicts it already shares, see ``from_optimizer``).

    torch's ``LRScheduler`` also wraps its optimizer's ``step`` to warn when the schedule steps before the
    optimizer; wrap the new one the same way, or its first ``scheduler.step()`` warns that ``step`` was replaced.
    """
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step.__func__  # type: ignore[attr-defined]
    opt_ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
