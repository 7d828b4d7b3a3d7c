"""Strict bucket order: the per-step bookkeeping of the engines that launch gradient buckets from backward's hooks.

A bucket launches when it is complete *and* every bucket before it has launched, so every rank issues the same
collectives in the same order; what backward did not make ready launches at ``finish_gradient_synchronization``
(``rest``). Used by ``BucketedDDP`` and ``ZeRO2DDP``.

>>> order = BucketOrder([[0, 1], [2]], ["a", "b", "c"])
>>> list(order.mark_ready(2))  # bucket 1 is complete, but bucket 0 has not launched: nothing yet
[]
>>> list(order.mark_ready(1)), list(order.mark_ready(0))  # bucket 0 completes: 0, then the waiting 1
([], [0, 1])
>>> list(order.rest())
[]
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["BucketOrder"]


class BucketOrder:
    """Which gradients are ready this step and which bucket launches next.

    ``buckets``: parameter indices per bucket, in launch order; ``names``: for the error on a gradient ready twice.
    """

    def __init__(self, buckets: Sequence[Sequence[int]], names: Sequence[str]) -> None:
        self.names = list(names)
        self.sizes = [len(indices) for indices in buckets]
        self.bucket_of = [0] * len(self.names)
        for b, indices in enumerate(buckets):
            for i in indices:
                self.bucket_of[i] = b
        self.reset()

    def reset(self) -> None:
        """A new step: no gradient ready, no bucket launched."""
        self.ready = [False] * len(self.names)
        self.pending = list(self.sizes)
        self.next = 0

    def mark_ready(self, index: int) -> range:
        """Parameter ``index``'s gradient is ready: the buckets to launch now, in order (often none)."""
        if self.ready[index]:
            raise RuntimeError(
                f"The gradient of {self.names[index]!r} became ready twice in one step. With gradient "
                "accumulation, run every micro-batch but the last under `with ddp.no_sync():`."
            )
        self.ready[index] = True
        b = self.bucket_of[index]
        self.pending[b] -= 1
        start = self.next
        if b == start and not self.pending[b]:  # only then can anything launch
            count, pending = len(self.sizes), self.pending
            while self.next < count and not pending[self.next]:
                self.next += 1
        return range(start, self.next)

    def rest(self) -> range:
        """The buckets not launched yet, in order (at the end of backward); then every bucket counts as launched."""
        start, self.next = self.next, len(self.sizes)
        return range(start, self.next)
