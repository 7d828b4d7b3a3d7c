"""Which parameters travel together: our engines' buckets, torch DDP's buckets, ZeRO-1's owners. Pure Python.

``assign_buckets`` and ``assign_owners`` are the engines' own (``lightning_ddp.sync.assignment``, torch-free);
``ddp_buckets`` restates torch DDP's rule (``compute_bucket_assignment_by_size`` in ``reducer.cpp``: a bucket closes
after the tensor that reaches its limit, 1 MiB first then ``bucket_cap_mb``, in gradient-ready order), tested
against ``dist._compute_bucket_assignment_by_size``.
"""

from __future__ import annotations

from typing import Sequence

from lightning_ddp.sync.assignment import assign_buckets, assign_owners

__all__ = ["DDP_BUCKET_CAP_BYTES", "DDP_FIRST_BUCKET_BYTES", "MiB", "assign_buckets", "assign_owners", "ddp_buckets"]

MiB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MiB
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: a small first (last-layer) bucket starts communication early."""
DDP_BUCKET_CAP_BYTES = 25 * MiB
"""torch DDP's default ``bucket_cap_mb`` (25 MiB)."""


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
