"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm.

Importing the package registers ``naive_ddp``, ``flat_ddp``, ``overlap_ddp``, ``bucketed_ddp`` and ``zero1_ddp`` with
Lightning's ``StrategyRegistry``.
"""

from lightning_ddp.strategies import (
    BucketedDDPStrategy,
    FlatDDPStrategy,
    NaiveDDPStrategy,
    OverlapDDPStrategy,
    ZeRO1DDPStrategy,
)
from lightning_ddp.sync import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, ShardedOptimizer

__all__ = [
    "BucketedDDP",
    "BucketedDDPStrategy",
    "FlatDDP",
    "FlatDDPStrategy",
    "NaiveDDP",
    "NaiveDDPStrategy",
    "OverlapDDP",
    "OverlapDDPStrategy",
    "ShardedOptimizer",
    "ZeRO1DDPStrategy",
]
