"""Who owns which parameter, and how a step's parameters are laid out in flat buffers (pure functions)."""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_ddp.sync.assignment import assign_owners

__all__ = ["assign_owners", "layout", "nbytes"]


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements: torch's own ``tensor.nbytes`` (this name is kept for its importers)."""
    return tensor.nbytes


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
