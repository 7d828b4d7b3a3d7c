"""Overlap DDP: an async all-reduce per parameter, launched from its gradient hook during backward.

Recipe:

1. Register ``Tensor.register_post_accumulate_grad_hook`` on every trainable parameter.
2. During backward, when a parameter's gradient has been accumulated, divide its ``.grad`` by the world size and
   launch an async all-reduce (SUM) of it in place (pre-scaled, so the sum is the average), while autograd goes on
   computing the gradients of earlier layers.
3. ``finish_gradient_synchronization``: launch those not launched yet (a parameter without a gradient this step;
   zeros stand in for it), then wait for every all-reduce: ``.grad`` holds the average, nothing is left to divide.

Launch order is fixed to reverse ``module.parameters()`` order (the order backward produces gradients); a
gradient that arrives early waits for its predecessors, so every rank issues the same sequence of
collectives (see ``bucketed``). This is exactly ``BucketedDDP`` with one parameter per bucket, and is
implemented as such: one bucket holding one tensor is reduced in place, with no packing copy.

Compared with naive it hides communication behind backward; compared with bucketed it still pays the
per-call latency once per tensor.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.bucketed import BucketedDDP


class OverlapDDP(BucketedDDP):
    """All-reduce each gradient asynchronously as soon as backward has produced it."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        # A cap of 1 byte puts every parameter alone in its bucket (a parameter larger than the cap gets its own).
        super().__init__(module, bucket_size_mb=1 / 2**20, process_group=process_group)
