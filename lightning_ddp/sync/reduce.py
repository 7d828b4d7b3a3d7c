"""How one gradient bucket is averaged over the ranks: the bucketed engine's swappable reduce step.

torch DDP's communication hook in our terms: ``BucketReduce.launch(comm, bucket, label, layout)`` is called as soon
as a bucket is complete and returns a ``Reduction`` whose ``wait()`` gives the bucket's average (same dtype and
shape). ``AllReduceMean`` is the default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from lightning_ddp.sync.comm import Communicator, Pending

__all__ = ["AllReduceMean", "BucketLayout", "BucketReduce", "Reduction"]


@dataclass(frozen=True)
class BucketLayout:
    """Where each gradient lies in one flat bucket; the same on every rank and every step.

    Elements no tensor covers (the missing-gradient sentinel) must be averaged too, keeping 0 at 0 and signs.
    """

    index: int
    """The bucket's position in the launch order (0 is launched first)."""
    count: int
    """How many buckets a step launches (``index == count - 1``: the step's last)."""
    names: tuple[str, ...]
    """The parameters whose gradients the bucket holds, in bucket order."""
    shapes: tuple[torch.Size, ...]
    """Each gradient's shape."""
    offsets: tuple[int, ...]
    """Each gradient's first element in the flattened bucket (``bucket.view(-1)``)."""

    @classmethod
    def single(cls, name: str, shape: torch.Size) -> BucketLayout:
        """A bucket that is one tensor, for callers outside an engine (a bench, a test)."""
        return cls(0, 1, (name,), (torch.Size(shape),), (0,))


@dataclass
class Reduction:
    """A launched reduce step: wait for ``pending`` collectives, run ``finish``, hand back ``result``."""

    comm: Communicator
    pending: list[Pending]
    result: torch.Tensor
    """The bucket's average once ``wait()`` returns (with the bucket's dtype and shape)."""
    finish: Callable[[], None] | None = None
    """Work after the collectives (e.g. scaling or decompressing into ``result``)."""

    def wait(self) -> torch.Tensor:
        for pending in self.pending:
            self.comm.wait(pending)
        if self.finish is not None:
            self.finish()
        return self.result


class BucketReduce(ABC):
    """Average one flat bucket over the ranks of ``comm``; subclasses implement ``launch``."""

    @abstractmethod
    def launch(
        self, comm: Communicator, bucket: torch.Tensor, label: str, layout: BucketLayout | None = None
    ) -> Reduction:
        """Start averaging ``bucket`` (it may be modified in place); return what ``wait()`` finishes.
        ``layout`` ``None``: the bucket is one tensor of its own shape."""


class AllReduceMean(BucketReduce):
    """Divide the bucket by the world size, then SUM all-reduce it in place (gloo has no AVG)."""

    def launch(
        self, comm: Communicator, bucket: torch.Tensor, label: str, layout: BucketLayout | None = None
    ) -> Reduction:
        with comm.span("pack"):
            bucket.div_(comm.world_size)
        return Reduction(comm, [comm.all_reduce(bucket, label)], bucket)
