"""``DeferredGradSync``: the engine of ZeRO-1's ``reduce_scatter`` schedule, which leaves gradients local."""

from __future__ import annotations

from lightning_ddp.sync.base import GradSyncEngine


class DeferredGradSync(GradSyncEngine):
    """An engine that leaves gradients local; ``ShardedOptimizer(schedule="reduce_scatter")`` syncs them in step().

    Like every engine it broadcasts rank 0's parameters and buffers and supports ``no_sync()``, but
    ``finish_gradient_synchronization()`` communicates nothing: the optimizer reduce-scatters the gradients
    inside ``step()``.
    """

    def _synchronize(self) -> None:
        """Nothing to do here: ``ShardedOptimizer.step()`` reduce-scatters the gradients."""
