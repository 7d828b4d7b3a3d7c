"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm.

Importing the package registers ``naive_ddp``, ``flat_ddp``, ``overlap_ddp`` and ``bucketed_ddp`` with
Lightning's ``StrategyRegistry``.
"""

from lightning_ddp.strategies import (
    BucketedDDPStrategy,
    FlatDDPStrategy,
    NaiveDDPStrategy,
    OverlapDDPStrategy,
)
from lightning_ddp.sync import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP

__all__ = [
    "BucketedDDP",
    "BucketedDDPStrategy",
    "FlatDDP",
    "FlatDDPStrategy",
    "NaiveDDP",
    "NaiveDDPStrategy",
    "OverlapDDP",
    "OverlapDDPStrategy",
]
