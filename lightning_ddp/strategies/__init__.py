"""Thin Lightning strategies over ``lightning_ddp.sync``, registered in Lightning's ``StrategyRegistry``.

Importing this package registers every entry of ``lightning_ddp.catalogue`` that one of our classes builds;
``register_strategies()`` registers entries added since (it is idempotent). ``docs/algorithms.md`` describes them.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.strategies.fsdp2 import FSDP2Strategy
from lightning_ddp.strategies.named import BucketedDDPStrategy, FlatDDPStrategy, NaiveDDPStrategy, OverlapDDPStrategy
from lightning_ddp.strategies.zero1 import ZeRO1DDPStrategy
from lightning_ddp.strategies.zero2 import ZeRO2DDPStrategy


def register_strategies() -> None:
    """Make ``trainer.strategy: <name>`` resolvable for every catalogue entry our classes build."""
    GradSyncStrategy.register_strategies(StrategyRegistry)
    ZeRO1DDPStrategy.register_strategies(StrategyRegistry)
    ZeRO2DDPStrategy.register_strategies(StrategyRegistry)
    FSDP2Strategy.register_strategies(StrategyRegistry)


register_strategies()

__all__ = [
    "BucketedDDPStrategy",
    "FSDP2Strategy",
    "FlatDDPStrategy",
    "GradSyncStrategy",
    "NaiveDDPStrategy",
    "OverlapDDPStrategy",
    "ZeRO1DDPStrategy",
    "ZeRO2DDPStrategy",
    "register_strategies",
]
