"""``flat_ddp``: after backward, one all-reduce of all gradients flattened into one buffer (see ``lightning_ddp.sync.flat``)."""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync import FlatDDP


class FlatDDPStrategy(GradSyncStrategy):
    """After backward, one all-reduce of all gradients flattened into one buffer.

    Select it with ``trainer.strategy: flat_ddp``. Arguments as in ``GradSyncStrategy``.
    """

    strategy_name = "flat_ddp"

    @override
    def make_container(self, module: nn.Module) -> FlatDDP:
        return FlatDDP(module)
