"""Bucketed DDP with the gradients communicated in bf16: half the bytes, lossy (torch DDP's ``bf16_compress_hook``).
Its precision and cost: ``docs/algorithms.md``.
"""

from __future__ import annotations

import torch

from lightning_ddp.sync.bucketed import AllReduceMean, BucketedDDP, BucketLayout, BucketReduce, Reduction
from lightning_ddp.sync.comm import Communicator


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
    """``BucketedDDP`` whose buckets go over the wire in bf16; ``bucket_size_mb`` caps the uncompressed gradients."""

    reduce_class = BF16CompressedAllReduce
