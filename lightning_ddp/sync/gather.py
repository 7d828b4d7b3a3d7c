"""Gather every rank's state (nested dicts and lists of tensors and plain values) for a checkpoint.

One ``all_gather_object`` of the skeletons (tensors replaced by ``TensorSpec``), then one ``broadcast`` per tensor.
Not recorded: checkpoints are not training steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddp.sync.comm import Communicator

__all__ = ["TensorSpec", "gather_rank_states"]


@dataclass(frozen=True)
class TensorSpec:
    """Where a tensor stood in a state's skeleton: its shape and dtype (its values follow by broadcast)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _replace(state: Any, kind: type, replace: Callable[[Any], Any]) -> Any:
    """``state`` (nested dicts, lists and tuples) with each ``kind`` in it replaced by ``replace(it)``, in order."""
    if isinstance(state, kind):
        return replace(state)
    if isinstance(state, dict):
        return {key: _replace(value, kind, replace) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_replace(value, kind, replace) for value in state)
    return state


def gather_rank_states(
    state: Any, comm: Communicator, device: torch.device | str, dst: int | None = None
) -> list[Any] | None:
    """``[state of rank 0, state of rank 1, ...]`` (copies, tensors on CPU); a collective.

    ``device``: where tensors travel. With ``dst`` only that group rank gets the list; the others get ``None``.
    """
    local_tensors: list[torch.Tensor] = []

    def spec_of(tensor: torch.Tensor) -> TensorSpec:
        local_tensors.append(tensor)
        return TensorSpec(tuple(tensor.shape), tensor.dtype)

    skeleton = _replace(state, torch.Tensor, spec_of)  # each tensor replaced by its TensorSpec
    skeletons: list[Any] = [None] * comm.world_size
    dist.all_gather_object(skeletons, skeleton, group=comm.group)
    keep = dst is None or dst == comm.rank
    device = torch.device(device)
    states = []
    for r, rank_skeleton in enumerate(skeletons):
        specs: list[TensorSpec] = []
        _replace(rank_skeleton, TensorSpec, specs.append)
        received = []
        for position, spec in enumerate(specs):
            if r == comm.rank:
                buffer = local_tensors[position].detach().to(device, copy=True)
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.broadcast(buffer, src=comm.global_rank(r), group=comm.group)
            if keep:
                received.append(buffer.cpu())
        if keep:
            tensors = iter(received)
            states.append(_replace(rank_skeleton, TensorSpec, lambda _: next(tensors)))
    return states if keep else None
