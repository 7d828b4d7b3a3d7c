"""Thin Lightning strategies over ``lightning_ddp.sync``, registered in Lightning's ``StrategyRegistry``.

Importing this package registers ``<name>_ddp`` for every algorithm of ``lightning_ddp.sync.registry``,
``zero1_ddp``, ``zero2_ddp`` and ``fsdp2``; ``register_strategies()`` registers algorithms added since (it is
idempotent).

=========================  ==========================  ================================================================
name                       class path (for YAML)       engine
=========================  ==========================  ================================================================
``naive_ddp``              ``NaiveDDPStrategy``        ``lightning_ddp.sync.NaiveDDP``
``flat_ddp``               ``FlatDDPStrategy``         ``lightning_ddp.sync.FlatDDP``
``overlap_ddp``            ``OverlapDDPStrategy``      ``lightning_ddp.sync.OverlapDDP``
``bucketed_ddp``           ``BucketedDDPStrategy``     ``lightning_ddp.sync.BucketedDDP`` (25 MiB)
``bucketed_bf16_ddp``      ``GradSyncStrategy``        ``lightning_ddp.sync.BucketedBF16DDP`` (25 MiB)
``bucketed_powersgd_ddp``  ``GradSyncStrategy``        ``lightning_ddp.sync.BucketedPowerSGDDDP`` (25 MiB)
``<name>_ddp``             ``GradSyncStrategy``        any registered algorithm (``init_args: {algorithm: <name>}``)
``zero1_ddp``              ``ZeRO1DDPStrategy``        ``lightning_ddp.sync.ShardedOptimizer`` (ZeRO-1) over an engine
``zero2_ddp``              ``ZeRO2DDPStrategy``        ``lightning_ddp.sync.zero2.ZeRO2DDP`` and a ``ShardedOptimizer`` (ZeRO-2)
``fsdp2``                  ``FSDP2Strategy``           torch's ``fully_shard`` (FSDP2) per Transformer block; a baseline
=========================  ==========================  ================================================================

One row per registered algorithm, in registry order (``tests/dist/test_registry.py`` checks the table against the
registry). ``GradSyncStrategy`` rows take ``init_args: {algorithm: <name>}``.

Lightning's own ``ddp`` is the baseline; ``fsdp2`` is torch's fully sharded one (``strategies.fsdp2``). To add an algorithm, see ``lightning_ddp.sync.registry``: no strategy
class is needed.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.strategies.fsdp2 import FSDP2Strategy
from lightning_ddp.strategies.named import BucketedDDPStrategy, FlatDDPStrategy, NaiveDDPStrategy, OverlapDDPStrategy
from lightning_ddp.strategies.zero1 import ZeRO1DDPStrategy
from lightning_ddp.strategies.zero2 import ZeRO2DDPStrategy
from lightning_ddp.sync.registry import ALGORITHMS


def register_strategies() -> None:
    """Make ``trainer.strategy: <name>_ddp`` resolvable for every registered algorithm, ``zero1_ddp``, ``zero2_ddp``
    and ``fsdp2``."""
    GradSyncStrategy.register_strategies(StrategyRegistry)
    ZeRO1DDPStrategy.register_strategies(StrategyRegistry)
    ZeRO2DDPStrategy.register_strategies(StrategyRegistry)
    FSDP2Strategy.register_strategies(StrategyRegistry)


def strategy_names() -> list[str]:
    """Our strategy names: one per registered algorithm, then ``zero1_ddp``, ``zero2_ddp``, then ``fsdp2`` (torch's,
    our wrapper)."""
    return [algorithm.strategy_name for algorithm in ALGORITHMS.values()] + ["zero1_ddp", "zero2_ddp",
                                                                             FSDP2Strategy.strategy_name]


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
    "strategy_names",
]
