"""``zero2_ddp``: gradient and optimizer-state sharding (ZeRO stage 2; see ``lightning_ddp.sync.zero2``).

What it adds to ``ShardedOptimizerStrategy`` (``lightning_ddp.strategies.sharded``: sharded optimizers, clipping,
checkpoints):

- ``make_engine``: a ``ZeRO2DDP``, which reduces gradient buckets to their owners during backward and keeps only the
  owned gradients.
- ``shard``: each optimizer becomes a ``ShardedOptimizer`` with ``schedule="reduce_in_backward"`` whose owners are
  the engine's (``placement=engine.owner_of``): a rank steps exactly the parameters whose averaged gradients it holds.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import catalogue
from lightning_ddp.strategies.base import log_bucket_prediction
from lightning_ddp.strategies.sharded import ShardedOptimizerStrategy, check_no_fp16
from lightning_ddp.sync import GradSyncEngine
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.zero1 import CollectiveImpl, ShardedOptimizer
from lightning_ddp.sync.zero2 import ZeRO2DDP


class ZeRO2DDPStrategy(ShardedOptimizerStrategy):
    """Shard the gradients and the optimizer state over the ranks (ZeRO-2); ``configure_optimizers`` stays unchanged.

    Select it with ``trainer.strategy: zero2_ddp``, or configure it::

        strategy:
          class_path: lightning_ddp.strategies.ZeRO2DDPStrategy
          init_args: {bucket_size_mb: 25, collectives: auto, buckets_in_flight: 2}

    Args:
        bucket_size_mb: Bucket cap in MiB, as for ``bucketed_ddp``; ``null`` for one bucket per dtype, ``auto`` to
            predict it from an all-reduce microbenchmark when training starts (logged on rank 0).
        collectives: ``auto`` (one reduce per owner on gloo, reduce-scatter where the bucket's owner segments are
            nearly equal otherwise), ``native`` or ``per_owner``; see ``lightning_ddp.sync.zero2``.
        buckets_in_flight: How many launched buckets (each a send buffer of up to ``bucket_size_mb``) may wait at
            once; more overlap, more memory.
        **kwargs: The arguments of ``GradSyncStrategy`` (backend, timeout, start method); ``engine_settings`` is not
            one (the engine's settings are the arguments above).
    """

    def __init__(
        self,
        bucket_size_mb: Optional[Union[float, Literal["auto"]]] = 25.0,
        collectives: CollectiveImpl = "auto",
        buckets_in_flight: int = 2,
        **kwargs: Any,
    ) -> None:
        # Fail when the config is read, not after the processes have started.
        check_bucket_size(bucket_size_mb)
        ZeRO2DDP.check_settings(collectives=collectives, buckets_in_flight=buckets_in_flight)
        if kwargs.get("engine_settings"):
            raise ValueError(
                "zero2_ddp takes its engine's settings directly: set `bucket_size_mb`, `collectives` or "
                "`buckets_in_flight` under init_args instead of `engine_settings`."
            )
        # The default engine only stands for "an algorithm with buckets" in GradSyncStrategy's checks; make_engine builds ZeRO2DDP.
        super().__init__(algorithm=catalogue.DEFAULT_ENGINE, bucket_size_mb=bucket_size_mb, **kwargs)
        self.collectives = collectives
        self.buckets_in_flight = buckets_in_flight

    @property
    @override
    def strategy_name(self) -> str:
        return "zero2_ddp"

    @override
    def make_engine(self, module: nn.Module) -> GradSyncEngine:
        return log_bucket_prediction(ZeRO2DDP(
            module, bucket_size_mb=self.bucket_size_mb, collectives=self.collectives,
            buckets_in_flight=self.buckets_in_flight,
        ))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "zero2_ddp" not in strategy_registry:
            strategy_registry.register("zero2_ddp", cls, description=(cls.__doc__ or "").strip().splitlines()[0])

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
            optimizer, schedule="reduce_in_backward", collectives=self.collectives, placement=engine.owner_of
        )
