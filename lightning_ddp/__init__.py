"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm.

Importing the package is cheap and needs no Lightning: the names below load on first use. The layers:

==========================  ==================================================================================
``lightning_ddp.sync``      the pure-PyTorch core: engines, ZeRO-1, the algorithm registry (no Lightning)
``lightning_ddp.strategies``  thin Lightning strategies over the engines; importing it registers ``<name>_ddp``
                            for every algorithm (and ``zero1_ddp``) with Lightning's ``StrategyRegistry``
``lightning_ddp.callbacks`` the ``CommTimer`` and ``TraceRecorder`` callbacks over pure accounting
``lightning_ddp.trace``     reading and drawing profiler traces
``lightning_ddp.bench``     the benchmarks (sweep, memory, timer overhead)
``lightning_ddp.cli``       ``python -m lightning_ddp fit ...`` (registers the strategies)
==========================  ==================================================================================
"""

from __future__ import annotations

from lightning_ddp._lazy import lazy_exports

_SYNC = ["BucketedDDP", "FlatDDP", "NaiveDDP", "OverlapDDP", "Recorder", "ShardedOptimizer"]
_STRATEGIES = ["BucketedDDPStrategy", "FlatDDPStrategy", "GradSyncStrategy", "NaiveDDPStrategy", "OverlapDDPStrategy",
               "ZeRO1DDPStrategy"]
__all__ = sorted(_SYNC + _STRATEGIES)
__getattr__, __dir__ = lazy_exports(
    __name__, {**dict.fromkeys(_SYNC, "lightning_ddp.sync"), **dict.fromkeys(_STRATEGIES, "lightning_ddp.strategies")}
)
