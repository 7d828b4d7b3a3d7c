"""Bucketed DDP: async all-reduce of size-capped gradient buckets, launched during backward.

How a bucket is averaged is the swappable ``reduce`` step (``lightning_ddp.sync.reduce``). Recipe and measured
choices: ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.assignment import assign_buckets
from lightning_ddp.sync.base import GradSyncEngine
from lightning_ddp.sync.bucket_model import BucketPrediction, resolve_bucket_size
from lightning_ddp.sync.bucket_order import BucketOrder
from lightning_ddp.sync.buffers import agree_on_gradients
from lightning_ddp.sync.reduce import AllReduceMean, BucketLayout, BucketReduce, Reduction

MiB = 2**20


def check_bucket_size(bucket_size_mb: float | str | None) -> None:
    """Reject a bucket cap that cannot hold anything (the one check the engine and strategy share)."""
    if bucket_size_mb is None or bucket_size_mb == "auto":
        return
    if isinstance(bucket_size_mb, str) or not bucket_size_mb > 0:
        raise ValueError(
            f"bucket_size_mb must be > 0, 'auto' or null (a single bucket), got {bucket_size_mb!r}; "
            "set e.g. `bucket_size_mb: 25`."
        )


class _Bucket:
    """One bucket: its parameters, its layout and, if it has one, its persistent flat buffer and views into it."""

    __slots__ = ("indices", "params", "label", "layout", "buffer", "views")

    def __init__(self, indices: list[int], params: list[torch.Tensor], label: str, layout: BucketLayout,
                 buffered: bool, sentinel: bool):
        self.indices = indices
        self.params = params
        self.label = label
        self.layout = layout  # what the reduce step is told about the bucket (the sentinel is in no tensor)
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if buffered:
            numel = sum(p.numel() for p in params)
            self.buffer = torch.zeros(numel + int(sentinel), dtype=params[0].dtype, device=params[0].device)
            for param, offset in zip(params, layout.offsets):
                self.views.append(self.buffer[offset : offset + param.numel()].view_as(param))


class BucketedDDP(GradSyncEngine):
    """All-reduce gradient buckets of at most ``bucket_size_mb`` MiB as they fill during backward.

    Args:
        bucket_size_mb: Bucket cap in MiB; ``None`` for one bucket per dtype; ``"auto"`` to predict it.
        reduce: How a bucket is averaged (``lightning_ddp.sync.reduce``); default ``AllReduceMean()``.
    """

    uses_grad_hooks = True

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | Literal["auto"] | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        reduce: BucketReduce | None = None,
    ) -> None:
        check_bucket_size(bucket_size_mb)
        super().__init__(module, process_group)
        self.reduce = reduce if reduce is not None else AllReduceMean()
        self.bucket_prediction: BucketPrediction | None
        self.bucket_size_mb, self.bucket_prediction = resolve_bucket_size(bucket_size_mb, self.params, process_group)
        cap = None if self.bucket_size_mb is None else int(self.bucket_size_mb * MiB)
        nbytes = [p.nbytes for p in self.params]
        self.buckets = assign_buckets(nbytes, [p.dtype for p in self.params], cap)
        last = len(self.buckets) - 1
        self._buckets = [
            _Bucket(indices, [self.params[i] for i in indices], self._bucket_label(indices, b),
                    self._bucket_layout(indices, b), buffered=len(indices) > 1 or b == last, sentinel=b == last)
            for b, indices in enumerate(self.buckets)
        ]
        self._order = BucketOrder(self.buckets, self.param_names)
        self._reset_step()

    def _reset_step(self) -> None:
        self._order.reset()
        self._launched: list[Reduction] = []
        self._has_grad = [True] * len(self.params)  # locally, at its bucket's launch
        self._missing = False  # some local parameter had no gradient this step

    def _bucket_label(self, indices: list[int], b: int) -> str:
        return self.param_names[indices[0]] if len(indices) == 1 else f"bucket {b} ({len(indices)} tensors)"

    def _bucket_layout(self, indices: list[int], b: int) -> BucketLayout:
        offsets = [0]
        for i in indices[:-1]:
            offsets.append(offsets[-1] + self.params[i].numel())
        return BucketLayout(b, len(self.buckets), tuple(self.param_names[i] for i in indices),
                            tuple(self.params[i].shape for i in indices), tuple(offsets))

    def _on_grad_ready(self, index: int) -> None:
        for b in self._order.mark_ready(index):  # strict order: complete buckets whose predecessors launched
            self._launch(b)

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
                if b == len(self._buckets) - 1:  # the sentinel: every earlier bucket launched, so this is known
                    buffer[-1] = 1.0 if self._missing else 0.0
            tensor = buffer
        self._launched.append(self.reduce.launch(self.comm, tensor, bucket.label, bucket.layout))

    def _synchronize(self) -> None:
        for b in self._order.rest():  # what backward did not make ready (a parameter without a gradient here)
            self._launch(b)
        average = None
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
        if average is not None and average[-1].item() > 0:  # some rank had a missing gradient this step
            counts = agree_on_gradients(self.comm, self._has_grad, self.device)
            for param, count in zip(self.params, counts):
                if count == 0:  # no rank had a gradient: .grad = None, as in one process (the optimizer skips it)
                    param.grad = None
        self._reset_step()
