"""Naive DDP: after backward, one blocking all-reduce per gradient tensor.

Recipe (``finish_gradient_synchronization``, after the last backward):

1. Agree across ranks which parameters have a gradient at all (one tiny all-reduce of presence flags).
2. For each parameter with a gradient somewhere, in ``module.parameters()`` order: divide its gradient
   (zeros on a rank that has none) by the world size, all-reduce (SUM) it and wait for it.

Nothing overlaps: communication starts only after the whole backward, and one call per tensor pays the
per-call latency ~435 times for the xl model. It is the baseline the other engines improve on.
"""

from __future__ import annotations

import torch

from lightning_ddp.sync.base import GradSyncEngine
from lightning_ddp.sync.buffers import agree_on_gradients


class NaiveDDP(GradSyncEngine):
    """All-reduce each parameter's gradient individually after backward."""

    def _synchronize(self) -> None:
        counts = agree_on_gradients(self.comm, [p.grad is not None for p in self.params], self.device)
        for name, param, count in zip(self.param_names, self.params, counts):
            if count == 0:
                continue  # no rank has a gradient: leave .grad None, as single-process training would
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            with self.comm.span("pack"):
                param.grad.div_(self.world_size)  # pre-scaled: the sum of the scaled gradients is the average
            self.comm.wait(self.comm.all_reduce(param.grad, name))
