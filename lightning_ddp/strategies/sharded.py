"""``ShardedOptimizerStrategy``: what ``zero1_ddp`` and ``zero2_ddp`` share, over ``GradSyncStrategy``.

Each optimizer of ``configure_optimizers`` becomes ``shard(optimizer)``, its LR schedulers and the precision
plugin's clipping pointed at it.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import compat
from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync.sharding import ShardedOptimizer

__all__ = ["ShardedOptimizerStrategy", "check_no_fp16", "route_clipping"]

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
