"""Bucketed DDP with the gradients communicated in bf16: half the bytes, lossy.

Recipe: ``BucketedDDP`` (buckets filled and launched in order during backward, see ``bucketed``) with its reduce
step swapped for ``BF16CompressedAllReduce``, torch DDP's ``bf16_compress_hook``:

1. when a bucket launches, cast its flat buffer to bf16 and divide the copy by the world size;
2. SUM all-reduce the bf16 copy (async): half the bytes of fp32 on the wire;
3. in ``finish_gradient_synchronization``, after the wait, cast the result back into the bucket's buffer, which the
   gradients are views of.

What it costs: bf16 keeps 8 mantissa bits, so each rank's scaled gradient is rounded to ~0.4 % (relative) before
the sum, and the sum of n such numbers is rounded again in bf16 by the reduction. The optimizer sees the average
to that precision, not the fp32 one: training is no longer equal to single-process training (``exact=False`` in
the registry: the equivalence tests hold it to bf16 tolerances). What it saves: half the bytes; the two casts cost
a read and a write of the bucket each. ``python -m lightning_ddp.bench.compression`` measures both (the numbers:
``benchmarks/results/compression_cpu/results.md``).

Only buckets of a floating dtype wider than bf16 are compressed; a bf16 bucket is reduced as it is.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.bucketed import BucketedDDP
from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.reduce import AllReduceMean, BucketLayout, BucketReduce, Reduction

__all__ = ["BF16CompressedAllReduce", "BucketedBF16DDP"]


class BF16CompressedAllReduce(BucketReduce):
    """Average a bucket over the ranks in bf16: cast, divide by n, SUM all-reduce, cast back into the bucket."""

    def launch(
        self, comm: Communicator, bucket: torch.Tensor, label: str, layout: BucketLayout | None = None
    ) -> Reduction:
        if bucket.dtype == torch.bfloat16:
            return AllReduceMean().launch(comm, bucket, label)
        with comm.span("pack"):
            compressed = bucket.to(torch.bfloat16).div_(comm.world_size)

        def decompress() -> None:
            with comm.span("pack"):
                bucket.copy_(compressed)

        return Reduction(comm, [comm.all_reduce(compressed, f"{label} [bf16]")], bucket, finish=decompress)


class BucketedBF16DDP(BucketedDDP):
    """``BucketedDDP`` whose buckets go over the wire in bf16 (``BF16CompressedAllReduce``).

    Args:
        module: The model to train.
        bucket_size_mb: Bucket cap in MiB of the *uncompressed* gradients, as for ``BucketedDDP``.
        process_group: The group to average over (default: the world).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | Literal["auto"] | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group, reduce=BF16CompressedAllReduce())
