"""Which parameters travel together: our engines' buckets, torch DDP's buckets, ZeRO-1's owners. Pure Python.

``assign_buckets`` and ``assign_owners`` restate ``lightning_ddp.sync.bucketed.assign_buckets`` and
``lightning_ddp.sync.zero1.assign_owners`` without torch (those modules import it); ``tests/test_project.py``
checks that they agree. ``ddp_buckets`` restates torch DDP's rule (``compute_bucket_assignment_by_size`` in
``torch/csrc/distributed/c10d/reducer.cpp``, checked against ``dist._compute_bucket_assignment_by_size``):

- a bucket closes *after* the tensor that brings it to or past its limit (ours close *before* exceeding the cap);
- the first bucket's limit is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), every later one ``bucket_cap_mb``
  (25 MiB); since the first iteration is bucketed in the order gradients became ready (``_rebuild_buckets``),
  the steady state walks parameters in ready order.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

__all__ = ["DDP_BUCKET_CAP_BYTES", "DDP_FIRST_BUCKET_BYTES", "MiB", "assign_buckets", "assign_owners", "ddp_buckets"]

MiB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MiB
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first (last-layer) bucket is small so communication starts early."""
DDP_BUCKET_CAP_BYTES = 25 * MiB
"""torch DDP's default ``bucket_cap_mb`` (25 MiB)."""


def assign_buckets(nbytes: Sequence[int], cap_bytes: Optional[int], dtypes: Optional[Sequence[str]] = None) -> list[list[int]]:
    """Our engines' rule: walk parameters in reverse; close a bucket when the next one would exceed ``cap_bytes``.

    A dtype change also closes it; ``cap_bytes=None`` never closes (one bucket per dtype run).

    >>> assign_buckets([4, 4, 4, 12], cap_bytes=8)
    [[3], [2, 1], [0]]
    """
    dtypes = dtypes if dtypes is not None else [""] * len(nbytes)
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(nbytes))):
        too_big = cap_bytes is not None and current_bytes + nbytes[index] > cap_bytes
        if current and (too_big or dtypes[index] != dtypes[current[-1]]):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes[index]
    if current:
        buckets.append(current)
    return buckets


def ddp_buckets(nbytes: Sequence[int], order: Sequence[int], first_cap_bytes: int = DDP_FIRST_BUCKET_BYTES,
                cap_bytes: int = DDP_BUCKET_CAP_BYTES) -> list[list[int]]:
    """torch DDP's rule over parameters in ``order`` (the order their gradients become ready).

    Add the tensor, then close the bucket if it reached its limit: ``first_cap_bytes`` for the first bucket,
    ``cap_bytes`` after.

    >>> ddp_buckets([16, 16, 16, 48, 4, 4], order=range(6), first_cap_bytes=8, cap_bytes=32)
    [[0], [1, 2], [3], [4, 5]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in order:
        current.append(index)
        current_bytes += nbytes[index]
        if current_bytes >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def assign_owners(nbytes: Sequence[int], world_size: int) -> list[int]:
    """ZeRO-1's owners: largest parameter first, onto the least-loaded rank (ties: lower rank, then lower index).

    >>> assign_owners([4, 12, 8, 4], world_size=2)
    [1, 0, 1, 0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    heap = [(0, rank) for rank in range(world_size)]  # (load, rank): the min is the least-loaded, lowest rank
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + nbytes[index], rank))
    return owners
