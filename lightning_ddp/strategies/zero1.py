"""``zero1_ddp``: optimizer-state sharding (ZeRO stage 1) over our engines (see ``lightning_ddp.sync.zero1``).

What it adds to ``GradSyncStrategy``:

- ``make_engine``: with ``schedule: allreduce_broadcast`` the algorithm named by ``grad_sync`` (any entry of
  ``lightning_ddp.sync.registry``) all-reduces the gradients as usual; with ``schedule: reduce_scatter`` a
  ``DeferredGradSync`` leaves them local, because the optimizer reduce-scatters them in ``step()``.
- ``setup_optimizers``: after ``configure_optimizers`` (unchanged), each optimizer is replaced by a
  ``ShardedOptimizer.from_optimizer`` of it, which shares its parameter-group dicts, and every LR scheduler is
  re-pointed at the sharded optimizer. A recorder attached by an observer goes to the engine and to the
  sharded optimizers, so the ``CommTimer`` accounts the optimizer's collectives with the engine's.
- Checkpoints: ``ShardedOptimizer.state_dict()`` is a collective returning the consolidated state on every rank;
  Lightning calls it on every rank in ``dump_checkpoint`` and writes rank 0's, and loads the file on every rank
  on resume, where each rank keeps its shard. The file equals an unsharded run's (resumable under ``ddp`` too).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import compat
from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync import GradSyncEngine
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.registry import get_algorithm
from lightning_ddp.sync.zero1 import (
    CollectiveImpl,
    DeferredGradSync,
    Schedule,
    ShardedOptimizer,
    check_collective_impl,
    check_schedule,
)


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
        grad_sync: The algorithm that all-reduces gradients under ``allreduce_broadcast``: any registered one
            (``naive``, ``flat``, ``overlap``, ``bucketed``, ...). Ignored by ``reduce_scatter``.
        bucket_size_mb: Bucket cap in MiB of a ``grad_sync`` algorithm with buckets; ``null`` for one bucket.
        collectives: ``auto`` (per-owner reduce/broadcast on gloo, native reduce-scatter/all-gather otherwise),
            ``native`` or ``per_owner``; see ``lightning_ddp.sync.zero1``.
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method), ``engine_settings``
            included: the ``grad_sync`` engine's own settings (e.g. ``{rank: 4}`` for ``bucketed_powersgd``), checked
            against that algorithm; ignored by ``reduce_scatter``, like ``grad_sync``.
    """

    def __init__(
        self,
        schedule: Schedule = "reduce_scatter",
        grad_sync: str = "bucketed",
        bucket_size_mb: float | None = 25.0,
        collectives: CollectiveImpl = "auto",
        **kwargs: Any,
    ) -> None:
        # Fail when the config is read, not after the processes have started.
        check_schedule(schedule)
        check_collective_impl(collectives)
        check_bucket_size(bucket_size_mb)
        try:
            has_buckets = get_algorithm(grad_sync).has_bucket_size
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

    @override
    def _recorded(self) -> list[Any]:
        return [*super()._recorded(), *(o for o in self.optimizers if isinstance(o, ShardedOptimizer))]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "zero1_ddp" not in strategy_registry:
            strategy_registry.register("zero1_ddp", cls, description=(cls.__doc__ or "").strip().splitlines()[0])

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        check_supported(self.schedule, str(trainer.precision), trainer.gradient_clip_val)
        super().setup(trainer)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers, as written by the user
        sharded = [self._shard(optimizer) for optimizer in self.optimizers]
        for config in self.lr_scheduler_configs:
            for original, replacement in zip(self.optimizers, sharded):
                if config.scheduler.optimizer is original and replacement is not original:
                    compat.repoint_scheduler(config.scheduler, replacement)
        self.optimizers = sharded
        if self._recorder is not None:
            self.attach_recorder(self._recorder)

    def _shard(self, optimizer: Optimizer) -> Optimizer:
        if compat.is_mock_optimizer(optimizer):  # configure_optimizers returned None: nothing to shard
            return optimizer
        if not isinstance(optimizer, ShardedOptimizer):
            optimizer = ShardedOptimizer.from_optimizer(optimizer, schedule=self.schedule, collectives=self.collectives)
        elif optimizer.schedule != self.schedule:  # sharded by the user: its schedule must match our engine
            raise ValueError(
                f"configure_optimizers returned a ShardedOptimizer with schedule={optimizer.schedule!r}, but the "
                f"strategy runs schedule={self.schedule!r}; return a plain optimizer (the strategy shards it) or set "
                f"`--trainer.strategy.init_args.schedule {optimizer.schedule}`."
            )
        return optimizer


def check_supported(schedule: str, precision: str, gradient_clip_val: float | None) -> None:
    """Refuse what ``schedule: reduce_scatter`` cannot do: anything that reads gradients before ``optimizer.step()``
    averages them (they are still local there)."""
    if schedule != "reduce_scatter":
        return
    if gradient_clip_val:
        raise ValueError(
            "Gradient clipping needs gradients averaged over the ranks, but `schedule: reduce_scatter` averages "
            "them inside optimizer.step(), after Lightning clips. Use "
            "`--trainer.strategy.init_args.schedule allreduce_broadcast` or drop `gradient_clip_val`."
        )
    if precision.startswith("16"):
        raise ValueError(
            f"precision={precision!r} with `schedule: reduce_scatter` could hang: fp16's GradScaler checks each "
            "rank's *local* gradients for inf before optimizer.step(), so one rank may skip the step (and its "
            "reduce-scatter and all-gather) while the others wait in them until the timeout. Use "
            "`--trainer.precision bf16-mixed` (no scaler), or `--trainer.strategy.init_args.schedule "
            "allreduce_broadcast` (gradients are averaged in backward, so every rank sees the same inf)."
        )
