"""Test-only strategies with a known, injected delay, for checking that the CommTimer measures what it should.

Used through the CLI as ``--trainer.strategy tests.support.timing_helpers.SlowNaiveDDPStrategy``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.strategies import GradSyncStrategy
from lightning_ddp.sync import Communicator, NaiveDDP, OverlapDDP


class _DelayedCommunicator(Communicator):
    """Every all-reduce call costs ``delay_s`` more: a slower network."""

    def __init__(self, group: Any, delay_s: float) -> None:
        super().__init__(group)
        self.delay_s = delay_s

    def all_reduce(self, tensor: torch.Tensor, label: str) -> dist.Work:
        time.sleep(self.delay_s)
        return super().all_reduce(tensor, label)


class _SlowAllReduceNaive(NaiveDDP):
    def __init__(self, module: nn.Module, delay_ms: float) -> None:
        super().__init__(module)
        self.comm = _DelayedCommunicator(self.process_group, delay_ms / 1e3)


class SlowNaiveDDPStrategy(GradSyncStrategy):
    """``naive_ddp`` whose every all-reduce call takes ``delay_ms`` longer."""

    def __init__(self, delay_ms: float = 0.0, **kwargs: Any) -> None:
        super().__init__(algorithm="naive_ddp", **kwargs)
        self.delay_ms = delay_ms

    def make_engine(self, module: nn.Module) -> NaiveDDP:
        return _SlowAllReduceNaive(module, self.delay_ms)


class _SlowBackwardOverlap(OverlapDDP):
    def __init__(self, module: nn.Module, delay_ms: float) -> None:
        super().__init__(module)
        self.delay_s = delay_ms / 1e3

    def _on_grad_ready(self, index: int) -> None:
        super()._on_grad_ready(index)  # launches the all-reduce...
        time.sleep(self.delay_s)  # ...then backward "computes" for delay_ms more before the next gradient


class SlowBackwardOverlapDDPStrategy(GradSyncStrategy):
    """``overlap_ddp`` whose backward takes ``delay_ms`` longer after each gradient is ready."""

    def __init__(self, delay_ms: float = 0.0, **kwargs: Any) -> None:
        super().__init__(algorithm="overlap_ddp", **kwargs)
        self.delay_ms = delay_ms

    def make_engine(self, module: nn.Module) -> OverlapDDP:
        return _SlowBackwardOverlap(module, self.delay_ms)
