"""Bucketed DDP: async all-reduce of size-capped gradient buckets, launched during backward, averaged by a swappable
reduce step (``BucketReduce``, torch DDP's communication hook); and ``BucketEngine``, what every engine that launches
buckets from backward's hooks shares (the cap, the buckets, their strict order). Recipe: ``docs/algorithms.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.assignment import assign_buckets
from lightning_ddp.sync.base import GradSyncEngine, agree_on_gradients, views
from lightning_ddp.sync.bucket_model import BucketPrediction, predict_bucket_size
from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.memory_model import bucket_cap_bytes, buffer_numel, owns_buffer, sentinel_numel


def check_bucket_size(bucket_size_mb: float | str | None) -> None:
    """Reject a bucket cap that cannot hold anything (the one check the engine and strategy share)."""
    if bucket_size_mb is None or bucket_size_mb == "auto":
        return
    if isinstance(bucket_size_mb, str) or not bucket_size_mb > 0:
        raise ValueError(
            f"bucket_size_mb must be > 0, 'auto' or null (a single bucket), got {bucket_size_mb!r}; "
            "set e.g. `bucket_size_mb: 25`."
        )


@dataclass(frozen=True)
class BucketLayout:
    """Where each gradient lies in one flat bucket; the same on every rank and every step.

    Elements no tensor covers (the missing-gradient sentinel) must be averaged too, keeping 0 at 0 and signs.
    """

    index: int  # the bucket's position in the launch order (0 is launched first)
    count: int  # how many buckets a step launches (index == count - 1: the step's last)
    names: tuple[str, ...]  # the parameters whose gradients the bucket holds, in bucket order
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # each gradient's first element in the flattened bucket


@dataclass
class Reduction:
    """A launched reduce step: wait for ``pending`` collectives, run ``finish``, hand back ``result``."""

    comm: Communicator
    pending: list[dist.Work]
    result: torch.Tensor  # the bucket's average once wait() returns (with the bucket's dtype and shape)
    finish: Callable[[], None] | None = None  # work after the collectives, e.g. decompressing into result

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


class BucketOrder:
    """Which gradients are ready this step and which bucket launches next (strict order).

    A bucket launches when it is complete *and* every bucket before it has launched, so every rank issues the same
    collectives in the same order; what backward did not make ready launches at the end (``rest``). ``buckets``:
    parameter indices per bucket, in launch order; ``names``: for the error on a gradient ready twice.

    >>> order = BucketOrder([[0, 1], [2]], ["a", "b", "c"])
    >>> list(order.mark_ready(2))  # bucket 1 is complete, but bucket 0 has not launched: nothing yet
    []
    >>> list(order.mark_ready(1)), list(order.mark_ready(0))  # bucket 0 completes: 0, then the waiting 1
    ([], [0, 1])
    >>> list(order.rest())
    []
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


class _Bucket:
    """Bucket ``b`` of ``count``: its parameters, its layout and, where the memory model says it owns one
    (``owns_buffer``: several tensors, or the last bucket), its persistent flat buffer and views into it; the last
    bucket's buffer ends in the missing-gradient sentinel."""

    __slots__ = ("indices", "params", "label", "layout", "has_sentinel", "buffer", "views")

    def __init__(self, b: int, count: int, indices: list[int], params: list[torch.Tensor], names: list[str]) -> None:
        self.indices = indices
        self.params = params
        self.label = names[0] if len(indices) == 1 else f"bucket {b} ({len(indices)} tensors)"
        offsets = list(accumulate((param.numel() for param in params[:-1]), initial=0))
        # What the reduce step is told about the bucket (the sentinel is in no tensor).
        self.layout = BucketLayout(b, count, tuple(names), tuple(p.shape for p in params), tuple(offsets))
        self.has_sentinel = sentinel_numel(b, count) > 0
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if owns_buffer(b, count, len(indices)):
            numel = buffer_numel(b, count, [param.numel() for param in params])
            self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
            self.views = list(views(self.buffer, params))


class BucketEngine(GradSyncEngine):
    """Base of the engines that launch gradient buckets of at most ``bucket_size_mb`` MiB from backward's hooks, in
    strict order; subclasses implement ``_launch(b)`` and finish with ``_launch_rest()`` in ``_synchronize``."""

    uses_grad_hooks = True

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | Literal["auto"] | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_bucket_size(bucket_size_mb)
        super().__init__(module, process_group)
        self.bucket_prediction: BucketPrediction | None = None
        if bucket_size_mb == "auto":  # predict the cap: a collective
            self.bucket_prediction = predict_bucket_size(self.params, process_group)
            bucket_size_mb = self.bucket_prediction.bucket_size_mb
        self.bucket_size_mb: float | None = bucket_size_mb
        cap = bucket_cap_bytes(self.bucket_size_mb)
        self.bucket_indices = assign_buckets([p.nbytes for p in self.params], [p.dtype for p in self.params], cap)
        """The indices (into ``params``) of each bucket's parameters, buckets in launch order."""
        self._order = BucketOrder(self.bucket_indices, self.param_names)

    def _reset_step(self) -> None:
        self._order.reset()

    def _on_grad_ready(self, index: int) -> None:
        for b in self._order.mark_ready(index):  # strict order: complete buckets whose predecessors launched
            self._launch(b)

    def _launch_rest(self) -> None:
        """Launch what backward did not make ready (a parameter without a gradient here)."""
        for b in self._order.rest():
            self._launch(b)

    def _launch(self, b: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _launch()")


class BucketedDDP(BucketEngine):
    """All-reduce gradient buckets of at most ``bucket_size_mb`` MiB as they fill during backward.

    Args:
        bucket_size_mb: Bucket cap in MiB; ``None`` for one bucket per dtype; ``"auto"`` to predict it.
        reduce: How a bucket is averaged (a ``BucketReduce``, above); default ``reduce_class()``.
    """

    reduce_class: type[BucketReduce] = AllReduceMean  # a subclass that only averages differently names its own

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | Literal["auto"] | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        reduce: BucketReduce | None = None,
    ) -> None:
        super().__init__(module, bucket_size_mb, process_group)
        self.reduce = reduce if reduce is not None else self.reduce_class()
        self._buckets = [
            _Bucket(b, len(self.bucket_indices), indices, [self.params[i] for i in indices],
                    [self.param_names[i] for i in indices])
            for b, indices in enumerate(self.bucket_indices)
        ]
        self._reset_step()

    def _reset_step(self) -> None:
        super()._reset_step()
        self._launched: list[Reduction] = []
        self._has_grad = [True] * len(self.params)  # locally, at its bucket's launch
        self._missing = False  # some local parameter had no gradient this step

    def _launch(self, b: int) -> None:
        assert b == len(self._launched), "buckets must launch in order"
        bucket = self._buckets[b]
        buffer = bucket.buffer
        if buffer is None:  # one tensor, reduced in place in its .grad
            (param,) = bucket.params
            grad = param.grad
            if grad is None:
                self._has_grad[bucket.indices[0]] = False
                self._missing = True
                grad = torch.zeros_like(param)
            tensor = grad
        else:
            with self.comm.span("pack"):
                for i, param, view in zip(bucket.indices, bucket.params, bucket.views):
                    grad = param.grad
                    if grad is None:
                        self._has_grad[i] = False
                        self._missing = True
                        view.zero_()
                    elif grad.data_ptr() != view.data_ptr():  # not accumulated in place into the view
                        view.copy_(grad)
                if bucket.has_sentinel:  # the last bucket: every earlier one launched, so this is known
                    buffer[-1] = 1.0 if self._missing else 0.0
            tensor = buffer
        self._launched.append(self.reduce.launch(self.comm, tensor, bucket.label, bucket.layout))

    def _synchronize(self) -> None:
        self._launch_rest()
        for bucket, reduction in zip(self._buckets, self._launched):
            average = reduction.wait()
            if bucket.buffer is None:  # reduced in place: .grad already holds it, unless the rank had none
                (param,) = bucket.params
                if param.grad is None:
                    param.grad = average
                elif average.data_ptr() != param.grad.data_ptr():
                    param.grad.copy_(average)
            else:  # gradients as views into the bucket: nothing to copy back
                for param, view in zip(bucket.params, bucket.views):
                    if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                        param.grad = view
        if self._some_rank_missed_a_gradient():
            counts = agree_on_gradients(self.comm, self._has_grad, self.device)
            for param, count in zip(self.params, counts):
                if count == 0:  # no rank had a gradient: .grad = None, as in one process (the optimizer skips it)
                    param.grad = None
        self._reset_step()

    def _some_rank_missed_a_gradient(self) -> bool:
        """The averaged sentinel (the last element of the last bucket, which owns a buffer), once every bucket has been
        waited for: > 0 when some rank had no gradient for one of its parameters this step."""
        if not self._buckets:
            return False
        last = self._buckets[-1].buffer
        assert last is not None, "the memory model gives the last bucket a buffer, for its sentinel"
        return last[-1].item() > 0
