"""Flat DDP: after backward, one all-reduce of every gradient flattened into a single buffer.

Recipe (``finish_gradient_synchronization``, after the last backward):

1. Agree across ranks which parameters have a gradient at all (one tiny all-reduce of presence flags).
2. Pack: concatenate those gradients (zeros where a rank has none) into one flat buffer per dtype.
3. One all-reduce (SUM) per buffer; wait for it.
4. Unpack: copy each slice back into its ``.grad``, divided by the world size.

One call pays the per-call latency once, at the price of the pack/unpack copies (recorded separately as
``pack``) and a buffer the size of all gradients. Still nothing overlaps with backward.
"""

from __future__ import annotations

import torch

from lightning_ddp.sync.base import DataParallel


class FlatDDP(DataParallel):
    """Flatten all gradients into one buffer (per dtype) and all-reduce it once after backward."""

    def _synchronize(self) -> None:
        counts = self._agree_on_gradients([p.grad is not None for p in self.params])
        synced = [p for p, count in zip(self.params, counts) if count > 0]
        groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in synced:
            groups.setdefault(param.dtype, []).append(param)
        for dtype, params in groups.items():
            start = self.clock.mark()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._pack_interval(start)
            work, collective = self._all_reduce(flat, f"flat {dtype} ({len(params)} tensors)")
            self._wait(work, collective)
            start = self.clock.mark()
            flat.div_(self.world_size)
            offset = 0
            for param in params:
                n = param.numel()
                value = flat[offset : offset + n].view_as(param)
                if param.grad is None:
                    param.grad = value.clone()
                else:
                    param.grad.copy_(value)
                offset += n
            self._pack_interval(start)
