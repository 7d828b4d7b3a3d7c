"""Thin Lightning strategies over ``lightning_ddp.sync``: importing this package registers in Lightning's
``StrategyRegistry`` every entry of ``lightning_ddp.catalogue`` that one of our classes builds.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp import catalogue
from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.strategies.fsdp2 import FSDP2Strategy
from lightning_ddp.strategies.hsdp import HSDPStrategy
from lightning_ddp.strategies.sharded import ZeRO1DDPStrategy, ZeRO2DDPStrategy

__all__ = ["FSDP2Strategy", "GradSyncStrategy", "HSDPStrategy", "ZeRO1DDPStrategy", "ZeRO2DDPStrategy",
           "register_strategies"]


def register_strategies() -> None:
    """Make ``trainer.strategy: <name>`` resolvable for every catalogue entry one of our classes builds."""
    for entry in catalogue.STRATEGIES.values():
        package, _, class_name = entry.lightning_class.rpartition(".")
        if package == __name__ and entry.name not in StrategyRegistry:
            StrategyRegistry.register(entry.name, globals()[class_name], description=entry.summary, **entry.init_args)


register_strategies()
