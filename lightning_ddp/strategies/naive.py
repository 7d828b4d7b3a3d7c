"""``naive_ddp``: after backward, all-reduce every gradient tensor, one blocking call each (see ``lightning_ddp.sync.naive``)."""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from lightning_ddp.strategies.base import GradSyncStrategy
from lightning_ddp.sync import NaiveDDP


class NaiveDDPStrategy(GradSyncStrategy):
    """After backward, all-reduce every gradient tensor, one blocking call each.

    Select it with ``trainer.strategy: naive_ddp``. Arguments as in ``GradSyncStrategy``.
    """

    strategy_name = "naive_ddp"

    @override
    def make_container(self, module: nn.Module) -> NaiveDDP:
        return NaiveDDP(module)
