"""Who owns which parameter, and how a step's parameters are laid out in flat buffers (pure functions)."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["assign_owners", "layout", "nbytes"]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def assign_owners(nbytes: Sequence[int], world_size: int, loads: Sequence[int] | None = None) -> list[int]:
    """The owner rank of each parameter: greedy, largest first, onto the least-loaded rank.

    Parameters are visited by decreasing size, ties by index; each goes to the rank with the fewest bytes so
    far, ties to the lower rank. Pure and deterministic, so every rank computes the same assignment. ``loads``
    are bytes the ranks already own (for parameters added later with ``add_param_group``).

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


def layout(
    indices: Sequence[int], params: Sequence[torch.Tensor], owners: Sequence[int], world_size: int
) -> list[tuple[torch.dtype, list[list[torch.Tensor]]]]:
    """``indices`` split by dtype (in order of first appearance), then by owner: ``[(dtype, segments)]`` where
    ``segments[r]`` lists the parameters rank ``r`` owns, in index order.

    >>> p = [torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(4)]
    >>> [(dtype, [[t.numel() for t in seg] for seg in segs]) for dtype, segs in layout([0, 1, 2], p, [1, 0, 0], 2)]
    [(torch.float32, [[4], [2]]), (torch.float64, [[3], []])]
    """
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for i in indices:
        segments = by_dtype.setdefault(params[i].dtype, [[] for _ in range(world_size)])
        segments[owners[i]].append(params[i])
    return list(by_dtype.items())
