"""Flat communication buffers and gradient presence: the pieces ``flat``, ``bucketed`` and the sharding share.

``agree_on_gradients`` sums "this parameter has a ``.grad`` here" over the ranks, so a parameter no rank has a
gradient for keeps ``None``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_ddp.sync.comm import Communicator

__all__ = ["agree_on_gradients", "pack", "packed", "unpack_gradients", "unpack_into"]


def pack(tensors: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``tensors`` (one per parameter in ``params``; zeros for ``None``) flat into ``out``, in order."""
    offset = 0
    for tensor, param in zip(tensors, params):
        chunk = out[offset : offset + param.numel()]
        if tensor is None:
            chunk.zero_()
        else:
            chunk.copy_(tensor.reshape(-1))
        offset += param.numel()


def packed(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new flat buffer holding the parameters' gradients (zeros where ``.grad`` is ``None``)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unpack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (``tensor.copy_``, in order)."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def unpack_gradients(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into each parameter's ``.grad`` (a clone where it was ``None``)."""
    offset = 0
    for param in params:
        n = param.numel()
        value = flat[offset : offset + n].view_as(param)
        if param.grad is None:
            param.grad = value.clone()
        elif value.data_ptr() != param.grad.data_ptr():
            param.grad.copy_(value)
        offset += n


def agree_on_gradients(comm: Communicator, has_grad: Sequence[bool], device: torch.device) -> list[int]:
    """For each parameter, on how many ranks it has a gradient (one small all-reduce; ``.tolist()`` blocks)."""
    flags = torch.tensor(list(has_grad), dtype=torch.int32, device=device)
    comm.wait(comm.all_reduce(flags, "gradient presence flags"))
    return flags.tolist()
