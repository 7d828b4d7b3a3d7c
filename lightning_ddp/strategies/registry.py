"""Our catalogue entries as names in Lightning's ``StrategyRegistry``: ``trainer.strategy: <name>``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp import catalogue
from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.strategies.fsdp2 import FSDP2Strategy
from lightning_ddp.strategies.hsdp import HSDPStrategy
from lightning_ddp.strategies.sharded import ZeRO1DDPStrategy, ZeRO2DDPStrategy

OUR_CLASSES = {cls.__name__: cls for cls in (GradSyncStrategy, FSDP2Strategy, HSDPStrategy, ZeRO1DDPStrategy,
                                             ZeRO2DDPStrategy)}
"""Class name -> class of every strategy this package defines (a catalogue entry names its class by path)."""


def register_strategies() -> None:
    """Make ``trainer.strategy: <name>`` resolvable for every catalogue entry one of our classes builds (idempotent)."""
    for entry in catalogue.STRATEGIES.values():
        package, _, class_name = entry.lightning_class.rpartition(".")
        if package == "lightning_ddp.strategies" and entry.name not in StrategyRegistry:
            StrategyRegistry.register(entry.name, OUR_CLASSES[class_name], description=entry.summary,
                                      **entry.init_args)
