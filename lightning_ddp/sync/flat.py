"""Flat DDP: after backward, one all-reduce of every gradient flattened into a single buffer per dtype."""

from __future__ import annotations

import torch

from lightning_ddp.sync.base import GradSyncEngine, agree_on_gradients, unpack_gradients


class FlatDDP(GradSyncEngine):
    """Flatten all gradients into one buffer (per dtype) and all-reduce it once after backward."""

    def _synchronize(self) -> None:
        counts = agree_on_gradients(self.comm, [p.grad is not None for p in self.params], self.device)
        groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param, count in zip(self.params, counts):
            if count > 0:
                groups.setdefault(param.dtype, []).append(param)
        for dtype, params in groups.items():
            with self.comm.span("pack"):
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
                flat.div_(self.world_size)  # pre-scaled: the sum is then the average
            self.comm.wait(self.comm.all_reduce(flat, f"flat {dtype} ({len(params)} tensors)"))
            with self.comm.span("pack"):
                unpack_gradients(flat, params)
