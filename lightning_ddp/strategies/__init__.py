"""Thin Lightning strategies over ``lightning_ddp.sync``: importing this package registers in Lightning's
``StrategyRegistry`` every entry of ``lightning_ddp.catalogue`` that one of our classes builds (``registry``).
"""

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.strategies.fsdp2 import FSDP2Strategy
from lightning_ddp.strategies.hsdp import HSDPStrategy
from lightning_ddp.strategies.registry import register_strategies
from lightning_ddp.strategies.sharded import ZeRO1DDPStrategy, ZeRO2DDPStrategy

__all__ = ["FSDP2Strategy", "GradSyncStrategy", "HSDPStrategy", "ZeRO1DDPStrategy", "ZeRO2DDPStrategy",
           "register_strategies"]

register_strategies()
