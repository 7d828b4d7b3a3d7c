"""The memory model every reader shares: which gradient buckets keep a flat buffer and how large it is, ZeRO-2's
buffers in flight, and what one rank holds of a model sharded on dim 0 (FSDP2's ``fully_shard``). The engines build
their buffers by it; the memory pre-flight (``lightning_ddp.memory``) and the projection
(``lightning_ddp.projection.simulators``) price them by it. Pure Python, no torch. The formulas and how they were
measured: ``docs/memory.md``.

A sharded formula takes the number of ranks a state is sharded over (``shard_ranks``): the world for ``fsdp2``;
for a strategy that shards within groups and replicates across them, the group's size.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

MiB = 2**20
"""Bytes in a mebibyte, the unit of ``bucket_size_mb``."""

ADAM_MOMENTS = 2
"""AdamW's ``exp_avg`` and ``exp_avg_sq``, each as wide as its parameter."""

ZERO2_BUCKETS_IN_FLIGHT = 2
"""``ZeRO2DDP``'s default ``buckets_in_flight``: launched buckets whose send buffers may wait at once."""


def bucket_cap_bytes(bucket_size_mb: float | None) -> int | None:
    """The cap ``bucket_size_mb`` MiB in whole bytes; ``None`` (no cap: one bucket per dtype) stays ``None``."""
    return None if bucket_size_mb is None else int(bucket_size_mb * MiB)


# ---- the bucketed engines' buffers (sync/bucketed.py) -------------------------------------------------------------


def sentinel_numel(index: int, count: int) -> int:
    """Elements of the missing-gradient sentinel in bucket ``index`` of the ``count`` a step launches: 1 in the last,
    0 in the others. The last bucket launches after every other, when the rank knows whether one of its parameters
    got no gradient; averaged with the gradients, the sentinel tells every rank whether any rank missed one."""
    return 1 if index == count - 1 else 0


def owns_buffer(index: int, count: int, tensors: int) -> bool:
    """Whether bucket ``index`` of ``count``, of ``tensors`` gradients, keeps a flat buffer across steps: a bucket of
    several gradients is packed into one, and so is the last (its sentinel needs the room); a bucket of one other
    gradient is reduced in place in its ``.grad``."""
    return tensors > 1 or sentinel_numel(index, count) > 0


def buffer_numel(index: int, count: int, gradient_numels: Sequence[int]) -> int:
    """Elements of the flat buffer of bucket ``index`` of ``count`` (one that ``owns_buffer``): its gradients, in
    bucket order (each ``.grad`` becomes a view into it), then the sentinel.

    >>> buffer_numel(0, 2, [6, 4]), buffer_numel(1, 2, [6])  # the last bucket ends in the sentinel
    (10, 7)
    """
    return sum(gradient_numels) + sentinel_numel(index, count)


# ---- ZeRO-2's buffers (sync/zero2.py) -------------------------------------------------------------------------------


def zero2_buffer_bytes(cap_bytes: int | None, total_bytes: int,
                       buckets_in_flight: int = ZERO2_BUCKETS_IN_FLIGHT) -> int:
    """Bytes of ZeRO-2's gradient buckets beside the held shard during backward: the send buffers of the
    ``buckets_in_flight`` launched buckets and the bucket filling, each the cap or, with no cap or fewer gradient
    bytes (``total_bytes``) than it, every gradient."""
    bucket_bytes = total_bytes if cap_bytes is None else min(cap_bytes, total_bytes)
    return (buckets_in_flight + 1) * bucket_bytes


# ---- fully sharded: parameters, gradients and optimizer state split on dim 0 (torch's fully_shard) ----------------


def dim0_shard_numel(shape: Sequence[int], shard_ranks: int, rank: int = 0) -> int:
    """Elements ``rank`` holds of a tensor of ``shape`` split over ``shard_ranks`` ranks as ``fully_shard`` splits
    it: chunks of ``ceil(rows / shard_ranks)`` rows along dim 0, the last ranks' shorter or empty, so rank 0 holds
    the most; a 0-d tensor is one row.

    >>> [dim0_shard_numel((5, 3), 2, rank) for rank in range(2)]  # rows 0-2 and 3-4, 3 elements each
    [9, 6]
    """
    rows = shape[0] if len(shape) else 1
    chunk = -(-rows // shard_ranks)
    held_rows = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
    return held_rows * math.prod(shape[1:])


class UnshardedPeak(NamedTuple):
    """What a fully sharded model holds unsharded at its peak, beside its shards (in the units it was given)."""

    parameters: int  # the root group's, the block computing's and the next block's (all-gathered ahead)
    gradients: int  # the block whose gradients are being reduce-scattered while the next one computes


def fully_sharded_unsharded_peak(root: int, blocks: Sequence[int]) -> UnshardedPeak:
    """``UnshardedPeak`` of a model sharded as a ``root`` group and one group per block (their sizes, in bytes or
    elements); the largest blocks, to bound the peak whichever two are gathered."""
    largest_first = sorted(blocks, reverse=True)
    computing = largest_first[0] if largest_first else 0
    prefetched = largest_first[1] if len(largest_first) > 1 else 0
    return UnshardedPeak(parameters=root + computing + prefetched, gradients=computing)
