"""How one gradient bucket is averaged over the ranks: the bucketed engine's swappable reduce step.

This is torch DDP's communication hook (``DistributedDataParallel.register_comm_hook``) in our terms. The
bucketed engine calls ``reduce.launch(comm, bucket, label)`` as soon as a bucket is complete (during backward)
and ``reduction.wait()`` in ``finish_gradient_synchronization``; what ``wait()`` returns is the bucket's average
over the ranks, with the bucket's dtype and shape, and is unpacked into the gradients. Between the two, a
reduce step may communicate anything it likes (another dtype, fewer bytes, several collectives): the engine
never looks at what went over the wire.

================================  ===============================================================  ==========
reduce step                       recipe                                                           torch DDP
================================  ===============================================================  ==========
``AllReduceMean`` (the default)   divide the bucket by n, then SUM all-reduce it in place          ``allreduce_hook``
================================  ===============================================================  ==========

Another reduce step (compression, for instance) is a subclass of ``BucketReduce`` in its own engine file; see
``lightning_ddp.sync.registry`` for how an engine becomes an algorithm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from lightning_ddp.sync.comm import Communicator, Pending

__all__ = ["AllReduceMean", "BucketReduce", "Reduction"]


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
    def launch(self, comm: Communicator, bucket: torch.Tensor, label: str) -> Reduction:
        """Start averaging ``bucket`` (it may be modified in place); return what ``wait()`` finishes."""


class AllReduceMean(BucketReduce):
    """Divide the bucket by the world size, then SUM all-reduce it in place (gloo has no AVG).

    Pre-scaling, as torch DDP's default hook does, takes the division off the critical path: it runs when the
    bucket is launched (during backward for hook-driven buckets) instead of after the wait. For a power-of-two
    world size it is exact: ``a / 2 + b / 2 == (a + b) / 2`` in floating point (barring underflow).
    """

    def launch(self, comm: Communicator, bucket: torch.Tensor, label: str) -> Reduction:
        with comm.span("pack"):
            bucket.div_(comm.world_size)
        return Reduction(comm, [comm.all_reduce(bucket, label)], bucket)
