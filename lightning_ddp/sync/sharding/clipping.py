"""Gradient clipping when each rank holds only the gradients it owns (ZeRO-1 and ZeRO-2).

Norm: one scalar SUM all-reduce of the owners' squared norms, then each owner scales its own by torch's clamped
coefficient. Value: each owner clamps its own.
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
    """``norm``: scale by the global 2-norm (``clip_grad_norm_``); ``value``: clamp each element."""
    limit: float
    """``max_norm`` for ``norm``, ``clip_value`` for ``value``; > 0."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("norm", "value"):
            raise ValueError(f"clipping algorithm {self.algorithm!r} is not supported; use 'norm' or 'value'.")
        if not self.limit > 0:
            raise ValueError(f"the clipping limit must be > 0, got {self.limit!r}; set e.g. gradient_clip_val: 1.0.")


def global_grad_norm(comm: Communicator, owned: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of every rank's ``owned`` gradients together, float64 on ``device``; a collective."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in owned:
        squares += torch.linalg.vector_norm(grad).double().square()
    comm.wait(comm.all_reduce(squares.reshape(1), NORM_LABEL))
    return squares.sqrt()


def clip_owned_gradients(
    comm: Communicator, owned: Sequence[torch.Tensor], request: ClipRequest, device: torch.device
) -> torch.Tensor | None:
    """Apply ``request`` to the owned gradients; return the global norm for ``norm`` (the same on every rank)."""
    if request.algorithm == "value":
        for grad in owned:
            grad.clamp_(-request.limit, request.limit)
        return None
    norm = global_grad_norm(comm, owned, device)
    coefficient = torch.clamp(request.limit / (norm + EPS), max=1.0)
    for grad in owned:
        grad.mul_(coefficient.to(grad.dtype))
    return norm
