"""The ZeRO strategies over what they share (``ShardedOptimizerStrategy``): each optimizer of
``configure_optimizers`` becomes ``shard(optimizer)``, its LR schedulers and the precision plugin's clipping pointed
at it. ZeRO-1's schedules and ZeRO-2's: ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import catalogue, compat
from lightning_ddp.strategies.base import GradSyncStrategy, entry_of
from lightning_ddp.sync import GradSyncEngine
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.sharding import (
    COLLECTIVE_IMPLS, SCHEDULES, CollectiveImpl, Schedule, ShardedOptimizer, check_choice,
)
from lightning_ddp.sync.zero1 import DeferredGradSync
from lightning_ddp.sync.zero2 import ZeRO2DDP

_ROUTED = "_lightning_ddp_routes_sharded_clipping"


class ShardedOptimizerStrategy(GradSyncStrategy):
    """A ``GradSyncStrategy`` whose optimizers are ``ShardedOptimizer`` s; subclasses say how (``shard``)."""

    def shard(self, optimizer: Optimizer) -> Optimizer:
        """The sharded replacement of one optimizer of ``configure_optimizers`` (called once the engine exists)."""
        raise NotImplementedError(f"{type(self).__name__} must implement shard()")

    def check_supported(self, precision: str) -> None:
        """Refuse, before training, what this strategy cannot do at ``precision`` (a ``ValueError`` naming the fix)."""

    @override
    def _recorded(self) -> list[Any]:
        return [*super()._recorded(), *(o for o in self.optimizers if isinstance(o, ShardedOptimizer))]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.check_supported(str(trainer.precision))
        route_clipping(self.precision_plugin)
        super().setup(trainer)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers, as written by the user
        sharded = [o if compat.is_mock_optimizer(o) else self.shard(o) for o in self.optimizers]
        for config in self.lr_scheduler_configs:
            for original, replacement in zip(self.optimizers, sharded):
                if config.scheduler.optimizer is original and replacement is not original:
                    compat.repoint_scheduler(config.scheduler, replacement)
        self.optimizers = sharded
        if self._recorder is not None:
            self.attach_recorder(self._recorder)


def route_clipping(plugin: Precision) -> None:
    """Make ``plugin`` hand the clipping of a ``ShardedOptimizer`` to the optimizer's ``clip_grad_norm_`` /
    ``clip_grad_value_`` (idempotent; per instance, so every precision plugin keeps its class)."""
    if getattr(plugin, _ROUTED, False):
        return
    by_norm, by_value = plugin.clip_grad_by_norm, plugin.clip_grad_by_value

    def routed(local: Callable[[Optimizer, float], None], sharded: str) -> Callable[[Optimizer, float], None]:
        def clip(optimizer: Optimizer, clip_val: float) -> None:
            if isinstance(optimizer, ShardedOptimizer):
                getattr(optimizer, sharded)(clip_val)
            else:
                local(optimizer, clip_val)

        return clip

    plugin.clip_grad_by_norm = routed(by_norm, "clip_grad_norm_")  # type: ignore[method-assign]
    plugin.clip_grad_by_value = routed(by_value, "clip_grad_value_")  # type: ignore[method-assign]
    setattr(plugin, _ROUTED, True)


def check_no_fp16(precision: str, what: str, alternative: str) -> None:
    """Refuse fp16 (``GradScaler``) where the gradients before ``optimizer.step()`` differ across ranks."""
    if precision.startswith("16"):
        raise ValueError(
            f"precision={precision!r} with {what} could hang: fp16's GradScaler checks each rank's gradients for inf "
            "before optimizer.step(), and here they are not yet the same on every rank, so one rank may skip the step "
            "(and its collectives) while the others wait in them until the timeout. Use `--trainer.precision "
            f"bf16-mixed` (no scaler), or {alternative}."
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
        check_choice("schedule", schedule, SCHEDULES)
        check_choice("collectives", collectives, COLLECTIVE_IMPLS)
        check_bucket_size(bucket_size_mb)
        try:
            has_buckets = catalogue.get(grad_sync).has_bucket_size
        except ValueError as error:
            raise ValueError(f"grad_sync: {error}") from None
        super().__init__(algorithm=grad_sync, bucket_size_mb=bucket_size_mb if has_buckets else "default", **kwargs)
        self.schedule = schedule
        self.grad_sync = grad_sync
        self.collectives = collectives

    @override
    def reported_settings(self) -> tuple[float | str, dict[str, Any]]:
        bucket, engine_settings = super().reported_settings()  # the grad_sync engine's, under allreduce_broadcast
        return bucket, {"schedule": self.schedule, "grad_sync": self.grad_sync, "collectives": self.collectives,
                        **engine_settings}

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


class ZeRO2DDPStrategy(ShardedOptimizerStrategy):
    """Shard the gradients and the optimizer state over the ranks (ZeRO-2); ``configure_optimizers`` stays unchanged.

    Args:
        bucket_size_mb: Bucket cap in MiB; ``null`` for one bucket per dtype, or ``auto``.
        collectives: ``auto`` (per owner on gloo, native otherwise), ``native`` or ``per_owner``.
        buckets_in_flight: How many launched buckets (send buffers) may wait at once: more overlap, more memory.
        **kwargs: The arguments of ``GradSyncStrategy`` but ``engine_settings`` (the settings are the ones above).
    """

    def __init__(
        self,
        bucket_size_mb: Optional[Union[float, Literal["auto"]]] = 25.0,
        collectives: CollectiveImpl = "auto",
        buckets_in_flight: int = 2,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("engine_settings"):
            raise ValueError(
                "zero2_ddp takes its engine's settings directly: set `bucket_size_mb`, `collectives` or "
                "`buckets_in_flight` under init_args instead of `engine_settings`."
            )
        # The catalogue's engine (ZeRO2DDP), checked when the config is read, not after the processes have started.
        settings = {"collectives": collectives, "buckets_in_flight": buckets_in_flight}
        super().__init__(algorithm=entry_of(type(self)).name, bucket_size_mb=bucket_size_mb, engine_settings=settings,
                         **kwargs)

    @override
    def _catalogue_entry(self, algorithm: str) -> catalogue.Entry:
        return catalogue.get(algorithm)  # its own entry, not an engine GradSyncStrategy runs alone

    @override
    def check_supported(self, precision: str) -> None:
        check_no_fp16(precision, "zero2_ddp (each rank holds only its own gradients)", "`--trainer.strategy zero1_ddp "
                      "--trainer.strategy.init_args.schedule allreduce_broadcast`")

    @override
    def shard(self, optimizer: Optimizer) -> Optimizer:
        engine = self.engine
        assert isinstance(engine, ZeRO2DDP), "the engine is built before the optimizers (configure_ddp)"
        if isinstance(optimizer, ShardedOptimizer):
            raise ValueError(
                "configure_optimizers returned a ShardedOptimizer, but zero2_ddp must place each parameter on the "
                "rank its engine reduces the gradient to; return a plain optimizer (the strategy shards it)."
            )
        return ShardedOptimizer.from_optimizer(
            optimizer, schedule="reduce_in_backward", collectives=self.engine_settings["collectives"],
            placement=engine.owner_of
        )
