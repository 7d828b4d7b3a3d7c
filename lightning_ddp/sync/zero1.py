"""ZeRO stage 1's engine: ``DeferredGradSync`` leaves gradients local for ``ShardedOptimizer`` to reduce-scatter."""

from __future__ import annotations

from lightning_ddp.sync.base import GradSyncEngine


class DeferredGradSync(GradSyncEngine):
    """An engine that leaves gradients local; ``ShardedOptimizer(schedule="reduce_scatter")`` syncs them in step()."""

    def _synchronize(self) -> None:
        """Nothing to do here: ``ShardedOptimizer.step()`` reduce-scatters the gradients."""
