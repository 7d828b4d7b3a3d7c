"""Which parameters travel together: the bucketed engines' buckets and the ZeRO owners. Pure Python, no torch: the
projection simulates the same buckets and owners with them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def assign_buckets(nbytes: Sequence[int], dtypes: Sequence[Hashable], cap_bytes: int | None) -> list[list[int]]:
    """Group parameter indices into buckets, walking them in reverse order.

    A bucket closes when the next parameter would exceed ``cap_bytes`` (``None``: never) or the dtype changes.

    >>> assign_buckets([4, 4, 4, 12], ["float32"] * 4, cap_bytes=8)
    [[3], [2, 1], [0]]
    """
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


def assign_owners(nbytes: Sequence[int], world_size: int, loads: Sequence[int] | None = None) -> list[int]:
    """The owner rank of each parameter: greedy, largest first, onto the least-loaded rank.

    Ties go to the lower index and the lower rank, so every rank computes the same assignment. ``loads``: bytes
    the ranks already own.

    Sizes 12, 8, 4, 4 go to r0; r1; r1 (loads 12 : 8); r0 (12 : 12, a tie: the lower rank):

    >>> assign_owners([4, 12, 8, 4], world_size=2)
    [1, 0, 1, 0]

    Continuing from loads 16 : 12, the first 4 goes to r1, the second to r0 (16 : 16, a tie):

    >>> assign_owners([4, 4], world_size=2, loads=[16, 12])
    [1, 0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    current = list(loads) if loads is not None else [0] * world_size
    if len(current) != world_size:
        raise ValueError(f"loads has {len(current)} entries, expected one per rank ({world_size})")
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(world_size), key=lambda r: (current[r], r))
        owners[index] = rank
        current[rank] += nbytes[index]
    return owners
