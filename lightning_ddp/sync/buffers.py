"""Flat communication buffers and gradient presence: the pieces ``flat``, ``bucketed`` and the sharding share.

``agree_on_gradients`` sums "this parameter has a ``.grad`` here" over the ranks, so a parameter no rank has a
gradient for keeps ``None``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_ddp.sync.comm import Communicator, Pending

__all__ = [
    "agree_on_gradients", "launch_presence", "pack", "packed", "read_presence", "unpack_gradients", "unpack_into",
]


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


PRESENCE_LABEL = "gradient presence flags"


def launch_presence(
    comm: Communicator, has_grad: Sequence[bool], device: torch.device
) -> tuple[Pending, torch.Tensor]:
    """Start summing over ranks "this parameter has a ``.grad`` here" (one small async all-reduce)."""
    flags = torch.tensor(list(has_grad), dtype=torch.int32, device=device)
    return comm.all_reduce(flags, PRESENCE_LABEL), flags


def read_presence(comm: Communicator, launched: tuple[Pending, torch.Tensor]) -> list[int]:
    """For each parameter, on how many ranks it has a ``.grad`` (waits; ``.tolist()`` blocks the host)."""
    pending, flags = launched
    comm.wait(pending)
    return flags.tolist()


def agree_on_gradients(comm: Communicator, has_grad: Sequence[bool], device: torch.device) -> list[int]:
    """For each parameter, on how many ranks it has a gradient (one small all-reduce)."""
    return read_presence(comm, launch_presence(comm, has_grad, device))
