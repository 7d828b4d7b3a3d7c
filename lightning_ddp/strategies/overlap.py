"""``overlap_ddp``: during backward, an async all-reduce per gradient as soon as it is ready (see ``lightning_ddp.sync.overlap``)."""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync import OverlapDDP


class OverlapDDPStrategy(GradSyncStrategy):
    """During backward, an async all-reduce per gradient as soon as it is ready.

    Select it with ``trainer.strategy: overlap_ddp``. Arguments as in ``GradSyncStrategy``.
    """

    strategy_name = "overlap_ddp"

    @override
    def make_container(self, module: nn.Module) -> OverlapDDP:
        return OverlapDDP(module)
