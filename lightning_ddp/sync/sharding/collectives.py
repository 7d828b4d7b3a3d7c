"""The two collective phases of a sharded step, ``native`` (one padded flat buffer per dtype, one reduce-scatter or
all-gather) or ``per_owner`` (one reduce or broadcast per owner, no padding; the default on gloo).

Both issue the same collectives in the same order on every rank: the layout depends only on ownership, dtypes and
the agreed gradient presence.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_ddp.sync.buffers import agree_on_gradients, pack, unpack_gradients, unpack_into
from lightning_ddp.sync.comm import Communicator

__all__ = ["layout", "reduce_scatter_gradients", "share_parameters"]


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


def reduce_scatter_gradients(
    comm: Communicator, params: Sequence[torch.Tensor], owners: Sequence[int], trainable: list[int],
    impl: str, device: torch.device,
) -> None:
    """Leave each owner the average over ranks of its parameters' gradients (the others' ``.grad`` stay local);
    a parameter no rank has a gradient for keeps ``.grad = None`` everywhere."""
    if not trainable:
        return
    counts = agree_on_gradients(comm, [params[i].grad is not None for i in trainable], device)
    present = [i for i, count in zip(trainable, counts) if count > 0]
    world, rank = comm.world_size, comm.rank
    for dtype, segments in layout(present, params, owners, world):
        sizes = [sum(p.numel() for p in owned) for owned in segments]
        mine: torch.Tensor | None = None
        if impl == "native":
            width = max(sizes)  # every segment padded to the largest: reduce-scatter needs equal chunks
            send = torch.zeros(world * width, dtype=dtype, device=device)
            with comm.span("pack"):
                for r, owned in enumerate(segments):
                    pack([p.grad for p in owned], owned, send[r * width : r * width + sizes[r]])
            recv = torch.empty(width, dtype=dtype, device=device)
            comm.wait(comm.reduce_scatter(recv, send, f"gradients {dtype} ({len(present)} tensors)"))
            mine = recv[: sizes[rank]]
        else:
            launched = []  # (owner, buffer, pending), in rank order
            for r, owned in enumerate(segments):
                if sizes[r] == 0:
                    continue
                buffer = torch.empty(sizes[r], dtype=dtype, device=device)
                with comm.span("pack"):
                    pack([p.grad for p in owned], owned, buffer)
                launched.append((r, buffer, comm.reduce(buffer, r, f"gradients of rank {r} ({len(owned)} tensors)")))
            for r, buffer, pending in launched:
                comm.wait(pending)
                if r == rank:
                    mine = buffer  # only the owner's copy holds the sum
        if mine is not None:
            with comm.span("pack"):
                mine.div_(world)  # sum -> average (gloo has no AVG)
                unpack_gradients(mine, segments[rank])


def share_parameters(
    comm: Communicator, params: Sequence[torch.Tensor], owners: Sequence[int], trainable: list[int],
    impl: str, device: torch.device,
) -> None:
    """Send every trainable parameter from its owner to the other ranks (broadcasts, or one all-gather)."""
    world, rank = comm.world_size, comm.rank
    for dtype, segments in layout(trainable, params, owners, world):
        sizes = [sum(p.numel() for p in owned) for owned in segments]
        mine = segments[rank]
        received: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (flat values, their parameters)
        if impl == "native":
            width = max(sizes)
            send = torch.zeros(width, dtype=dtype, device=device)
            with comm.span("pack"):
                pack([p.detach() for p in mine], mine, send)
            gathered = torch.empty(world * width, dtype=dtype, device=device)
            comm.wait(comm.all_gather(gathered, send, f"parameters {dtype} ({len(trainable)} tensors)"))
            received = [(gathered[r * width : r * width + sizes[r]], owned) for r, owned in enumerate(segments)]
        else:
            launched = []
            for r, owned in enumerate(segments):
                if sizes[r] == 0:
                    continue
                buffer = torch.empty(sizes[r], dtype=dtype, device=device)
                if r == rank:
                    with comm.span("pack"):
                        pack([p.detach() for p in owned], owned, buffer)
                pending = comm.broadcast(buffer, r, f"parameters of rank {r} ({len(owned)} tensors)")
                launched.append((buffer, owned, pending))
            for buffer, owned, pending in launched:
                comm.wait(pending)
                received.append((buffer, owned))
        with comm.span("pack"):
            for flat, owned in received:
                if owned is not mine:  # this rank's own parameters are already up to date: it computed them
                    unpack_into(flat, [p.detach() for p in owned])
