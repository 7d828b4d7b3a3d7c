"""``zero2_ddp``: gradient and optimizer-state sharding (ZeRO stage 2) over ``ZeRO2DDP``.

Each optimizer becomes a ``ShardedOptimizer(schedule="reduce_in_backward", placement=engine.owner_of)``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import catalogue
from lightning_ddp.strategies.base import entry_of, log_bucket_prediction
from lightning_ddp.strategies.sharded import ShardedOptimizerStrategy, check_no_fp16
from lightning_ddp.sync import GradSyncEngine
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.sharding.optimizer import CollectiveImpl, ShardedOptimizer
from lightning_ddp.sync.zero2 import ZeRO2DDP


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
        # Fail when the config is read, not after the processes have started.
        check_bucket_size(bucket_size_mb)
        ZeRO2DDP.check_settings(collectives=collectives, buckets_in_flight=buckets_in_flight)
        if kwargs.get("engine_settings"):
            raise ValueError(
                "zero2_ddp takes its engine's settings directly: set `bucket_size_mb`, `collectives` or "
                "`buckets_in_flight` under init_args instead of `engine_settings`."
            )
        super().__init__(algorithm=entry_of(type(self)).name, bucket_size_mb=bucket_size_mb, **kwargs)
        self.collectives = collectives
        self.buckets_in_flight = buckets_in_flight

    @override
    def _catalogue_entry(self, algorithm: str) -> catalogue.Entry:
        return catalogue.get(algorithm)  # its own entry: the engine is ZeRO2DDP, built with the settings above

    @override
    def make_engine(self, module: nn.Module) -> GradSyncEngine:
        return log_bucket_prediction(ZeRO2DDP(
            module, bucket_size_mb=self.bucket_size_mb, collectives=self.collectives,
            buckets_in_flight=self.buckets_in_flight,
        ))

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
