"""Naive DDP: after backward, one blocking all-reduce per gradient tensor (the baseline)."""

from __future__ import annotations

import torch

from lightning_ddp.sync.base import GradSyncEngine, agree_on_gradients


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
