"""Thin Lightning strategies over ``lightning_ddp.sync``, registered in Lightning's ``StrategyRegistry``.

==================  ==========================  ==============================================
name                class                       engine
==================  ==========================  ==============================================
``naive_ddp``       ``NaiveDDPStrategy``        ``lightning_ddp.sync.NaiveDDP``
``flat_ddp``        ``FlatDDPStrategy``         ``lightning_ddp.sync.FlatDDP``
``overlap_ddp``     ``OverlapDDPStrategy``      ``lightning_ddp.sync.OverlapDDP``
``bucketed_ddp``    ``BucketedDDPStrategy``     ``lightning_ddp.sync.BucketedDDP`` (25 MiB)
``zero1_ddp``       ``ZeRO1DDPStrategy``        ``lightning_ddp.sync.ShardedOptimizer`` (ZeRO-1)
==================  ==========================  ==============================================

Lightning's own ``ddp`` is the baseline. To add a strategy: write the engine in ``lightning_ddp/sync``,
subclass ``GradSyncStrategy`` here with ``strategy_name`` and ``make_container``, and add it to ``STRATEGIES``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.strategies.bucketed import BucketedDDPStrategy
from lightning_ddp.strategies.flat import FlatDDPStrategy
from lightning_ddp.strategies.naive import NaiveDDPStrategy
from lightning_ddp.strategies.overlap import OverlapDDPStrategy
from lightning_ddp.strategies.zero1 import ZeRO1DDPStrategy

STRATEGIES: tuple[type[GradSyncStrategy], ...] = (
    NaiveDDPStrategy,
    FlatDDPStrategy,
    OverlapDDPStrategy,
    BucketedDDPStrategy,
    ZeRO1DDPStrategy,
)


def register_strategies() -> None:
    """Make ``trainer.strategy: naive_ddp`` (etc.) resolvable; idempotent."""
    for strategy in STRATEGIES:
        if strategy.strategy_name not in StrategyRegistry:
            strategy.register_strategies(StrategyRegistry)


register_strategies()

__all__ = [
    "BucketedDDPStrategy",
    "FlatDDPStrategy",
    "GradSyncStrategy",
    "NaiveDDPStrategy",
    "OverlapDDPStrategy",
    "STRATEGIES",
    "ZeRO1DDPStrategy",
    "register_strategies",
]
