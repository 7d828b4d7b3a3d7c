"""ZeRO stage 1's engine: ``DeferredGradSync`` leaves gradients local for ``ShardedOptimizer`` to reduce-scatter.

With ``schedule="reduce_scatter"`` (the ``zero1_ddp`` default) the model is wrapped in ``DeferredGradSync`` and the
optimizer (``lightning_ddp.sync.sharding``) syncs the gradients in ``step()``; with ``allreduce_broadcast`` any DDP
engine all-reduces them in backward instead. See ``docs/algorithms.md``.
"""

from __future__ import annotations

from lightning_ddp.sync.base import GradSyncEngine

__all__ = ["DeferredGradSync"]


class DeferredGradSync(GradSyncEngine):
    """An engine that leaves gradients local; ``ShardedOptimizer(schedule="reduce_scatter")`` syncs them in step().

    Like every engine it broadcasts rank 0's parameters and buffers and supports ``no_sync()``, but
    ``finish_gradient_synchronization()`` communicates nothing.
    """

    def _synchronize(self) -> None:
        """Nothing to do here: ``ShardedOptimizer.step()`` reduce-scatters the gradients."""
