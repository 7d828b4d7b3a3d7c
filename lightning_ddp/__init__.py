"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm.

Importing the package is cheap and needs no Lightning: the names below load on first use. It registers our
strategies with Lightning on import: ``import lightning_ddp`` makes ``Trainer(strategy="bucketed_ddp")`` (every
``<name>_ddp`` and ``zero1_ddp``) work, whether Lightning is imported before or after it, without importing
Lightning itself (``lightning_ddp._registration``: the names are registered when ``lightning.pytorch`` is
imported). Two layers, and the first never imports the second (``tests/unit/test_layers.py`` checks every import,
inside functions too):

The product: what a training run uses.

=============================  ===============================================================================
``lightning_ddp.sync``         the pure-PyTorch core: engines, ZeRO-1, the algorithm registry (no Lightning)
``lightning_ddp.strategies``   thin Lightning strategies over the engines, registered as ``<name>_ddp`` for every
                               algorithm (and ``zero1_ddp``) in Lightning's ``StrategyRegistry`` (see above)
``lightning_ddp.callbacks``    the ``CommTimer`` and ``TraceRecorder`` callbacks over pure accounting
``lightning_ddp.cli``          ``python -m lightning_ddp fit ...`` (registers the strategies)
``model``, ``module``,         the GPT, its LightningModule, the data modules, the memory pre-flight, GPU specs,
``data``, ``memory``,          and ``profile``: the compute-profile file the ``CommTimer`` writes and the
``hardware``, ``profile``      projection reads
=============================  ===============================================================================

The study: what the write-ups are made from.

=============================  ===============================================================================
``lightning_ddp.bench``        the benchmarks (sweep, memory, timer overhead, compression)
``lightning_ddp.projection``   step time projected to world sizes nobody ran (its old name,
                               ``lightning_ddp.project``, still works)
``lightning_ddp.trace``        reading and drawing profiler traces
=============================  ===============================================================================
"""

from __future__ import annotations

from lightning_ddp._lazy import lazy_exports
from lightning_ddp._registration import register_with_lightning

_SYNC = ["BucketedDDP", "FlatDDP", "NaiveDDP", "OverlapDDP", "Recorder", "ShardedOptimizer"]
_STRATEGIES = ["GradSyncStrategy", "ZeRO1DDPStrategy"]
__all__ = sorted(_SYNC + _STRATEGIES)
__getattr__, __dir__ = lazy_exports(
    __name__, {**dict.fromkeys(_SYNC, "lightning_ddp.sync"), **dict.fromkeys(_STRATEGIES, "lightning_ddp.strategies")}
)
register_with_lightning()
