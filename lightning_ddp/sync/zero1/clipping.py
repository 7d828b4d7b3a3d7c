"""Gradient clipping when each rank holds only the gradients it owns (ZeRO-1 and ZeRO-2).

One process clips with ``torch.nn.utils.clip_grad_norm_(params, max_norm)``: the global 2-norm of every gradient,
then every gradient scaled by ``max_norm / (norm + 1e-6)`` if that is below 1. Under sharding no rank holds every
averaged gradient, but each averaged gradient lives on exactly one owner, so:

1. each rank sums the squared 2-norms of the averaged gradients it owns (per tensor in the tensor's dtype, as torch
   does, then accumulated in float64, so mixed dtypes add up);
2. one SUM all-reduce of that scalar ("gradient norm", recorded like every collective) gives every rank the squared
   global norm; its root is the global norm, the same number on every rank;
3. each owner scales its owned gradients by torch's clamped coefficient. Only owned gradients feed an update, so
   the update equals one process's with clipping, up to the association of the norm's sum.

Value clipping (``clip_grad_value_``) is elementwise: it needs no communication, the owners clamp their own.

When: after the gradients reached their owners and before the owners step. ``ShardedOptimizer`` therefore takes a
clipping *request* (``clip_grad_norm_`` / ``clip_grad_value_``, what Lightning's precision plugin calls through the
strategy) and applies it inside ``step()``: for ``reduce_scatter`` the averages only exist there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from lightning_ddp.sync.comm import Communicator

__all__ = ["ClipRequest", "clip_owned_gradients", "global_grad_norm"]

NORM_LABEL = "gradient norm"
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclass(frozen=True)
class ClipRequest:
    """Clip the owned gradients at the next ``step()``."""

    algorithm: Literal["norm", "value"]
    """``norm``: scale by the global 2-norm (``clip_grad_norm_``); ``value``: clamp elementwise (``clip_grad_value_``)."""
    limit: float
    """``max_norm`` for ``norm``, ``clip_value`` for ``value``; > 0."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("norm", "value"):
            raise ValueError(f"clipping algorithm {self.algorithm!r} is not supported; use 'norm' or 'value'.")
        if not self.limit > 0:
            raise ValueError(f"the clipping limit must be > 0, got {self.limit!r}; set e.g. gradient_clip_val: 1.0.")


def global_grad_norm(comm: Communicator, owned: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of every rank's ``owned`` gradients together (a collective: every rank calls it), float64 on
    ``device``. ``owned``: the averaged gradients this rank owns (none is held by two ranks)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in owned:
        squares += torch.linalg.vector_norm(grad).double().square()
    comm.wait(comm.all_reduce(squares.reshape(1), NORM_LABEL))
    return squares.sqrt()


def clip_owned_gradients(
    comm: Communicator, owned: Sequence[torch.Tensor], request: ClipRequest, device: torch.device
) -> torch.Tensor | None:
    """Apply ``request`` to the owned gradients; return the global norm for ``norm`` (every rank the same), else None."""
    if request.algorithm == "value":
        for grad in owned:
            grad.clamp_(-request.limit, request.limit)
        return None
    norm = global_grad_norm(comm, owned, device)
    coefficient = torch.clamp(request.limit / (norm + EPS), max=1.0)
    for grad in owned:
        grad.mul_(coefficient.to(grad.dtype))
    return norm
