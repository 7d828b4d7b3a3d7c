"""Gather every rank's state (nested dicts and lists of tensors and plain values) for a checkpoint.

One ``all_gather_object`` of the skeletons (tensors replaced by ``TensorSpec``), then one ``broadcast`` per tensor.
Not recorded: checkpoints are not training steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from lightning_ddp.sync.comm import Communicator

__all__ = ["TensorSpec", "gather_rank_states"]


@dataclass(frozen=True)
class TensorSpec:
    """Where a tensor stood in a state's skeleton: its shape and dtype (its values follow by broadcast)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(state: Any, tensors: list[torch.Tensor]) -> Any:
    """``state`` with each tensor replaced by its ``TensorSpec``, the tensors appended to ``tensors`` in order."""
    if torch.is_tensor(state):
        tensors.append(state)
        return TensorSpec(tuple(state.shape), state.dtype)
    if isinstance(state, dict):
        return {key: _skeleton(value, tensors) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_skeleton(value, tensors) for value in state)
    return state


def _specs(skeleton: Any) -> list[TensorSpec]:
    if isinstance(skeleton, TensorSpec):
        return [skeleton]
    if isinstance(skeleton, dict):
        return [spec for value in skeleton.values() for spec in _specs(value)]
    if isinstance(skeleton, (list, tuple)):
        return [spec for value in skeleton for spec in _specs(value)]
    return []


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """The inverse of ``_skeleton``: each ``TensorSpec`` replaced by the next of ``tensors``, in order."""
    if isinstance(skeleton, TensorSpec):
        return next(tensors)
    if isinstance(skeleton, dict):
        return {key: _fill(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(value, tensors) for value in skeleton)
    return skeleton


def gather_rank_states(
    state: Any, comm: Communicator, device: torch.device | str, dst: int | None = None
) -> list[Any] | None:
    """``[state of rank 0, state of rank 1, ...]`` (copies, tensors on CPU); a collective.

    ``device``: where tensors travel. With ``dst`` only that group rank gets the list; the others get ``None``.
    """
    local_tensors: list[torch.Tensor] = []
    skeleton = _skeleton(state, local_tensors)
    skeletons: list[Any] = [None] * comm.world_size
    dist.all_gather_object(skeletons, skeleton, group=comm.group)
    keep = dst is None or dst == comm.rank
    device = torch.device(device)
    states = []
    for r, rank_skeleton in enumerate(skeletons):
        received = []
        for position, spec in enumerate(_specs(rank_skeleton)):
            if r == comm.rank:
                buffer = local_tensors[position].detach().to(device, copy=True)
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.broadcast(buffer, src=comm.global_rank(r), group=comm.group)
            if keep:
                received.append(buffer.cpu())
        if keep:
            states.append(_fill(rank_skeleton, iter(received)))
    return states if keep else None
