"""Bucketed DDP: async all-reduce of size-capped gradient buckets, launched during backward.

Recipe:

1. At construction, assign parameters to buckets of at most ``bucket_size_mb`` MiB (2**20 bytes), walking
   ``module.parameters()`` in *reverse*, the order in which backward produces gradients (output layer
   first, embedding last). A parameter larger than the cap gets a bucket of its own; a dtype change starts a
   new bucket. ``bucket_size_mb=None`` means one unbounded bucket per dtype.
2. During backward, a post-accumulate-grad hook marks each parameter ready. Buckets are launched strictly
   in bucket order: bucket ``i`` is all-reduced (async, SUM) as soon as it and every bucket before it are
   complete. A multi-parameter bucket is packed into one buffer; a one-parameter bucket is reduced in place.
3. ``finish_gradient_synchronization``: launch, in order, the buckets backward did not complete (they hold
   a parameter with no gradient this step; zeros stand in for it), then the small all-reduce of which
   parameters have gradients (see ``base``); wait for each bucket's average and unpack it into ``.grad``,
   every parameter of it; only then read the presence flags (``.tolist()`` blocks the host) and set
   ``.grad = None`` where no rank had a gradient. The flags are issued last and read last, so they never hold
   up the unpacking of a bucket that has already arrived.

How a bucket is averaged is the engine's ``reduce`` step (``lightning_ddp.sync.reduce``, torch DDP's comm hook in
our terms): by default a SUM all-reduce in place divided by the world size; another reduce step (e.g. one that
communicates in bf16) plugs in without touching the bucketing.

Why in order: collectives are matched by sequence position across ranks. Launching strictly in bucket order
makes the sequence identical on every rank even when some rank's gradient for a parameter is missing or late.

Trade-off (the seeds' bucket sweep): small buckets start communicating earlier but pay the per-call latency
many times; one huge bucket pays it once but cannot start before backward ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.base import DataParallel
from lightning_ddp.sync.bucket_model import BucketPrediction, predict_bucket_size
from lightning_ddp.sync.buffers import launch_presence, packed, read_presence, unpack_gradients
from lightning_ddp.sync.reduce import AllReduceMean, BucketReduce, Reduction

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


def assign_buckets(nbytes: list[int], dtypes: list[torch.dtype], cap_bytes: int | None) -> list[list[int]]:
    """Group parameter indices into buckets, walking them in reverse order.

    A bucket closes when adding the next parameter would exceed ``cap_bytes`` (``None``: never) or when the
    dtype changes. A parameter larger than the cap therefore sits alone in its bucket.

    >>> assign_buckets([4, 4, 4, 12], [torch.float32] * 4, cap_bytes=8)
    [[3], [2, 1], [0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(nbytes))):
        too_big = cap_bytes is not None and current_bytes + nbytes[index] > cap_bytes
        if current and (too_big or dtypes[index] != dtypes[current[-1]]):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes[index]
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(DataParallel):
    """All-reduce gradient buckets of at most ``bucket_size_mb`` MiB as they fill during backward.

    Args:
        module: The model to train; any ``nn.Module``.
        bucket_size_mb: Bucket cap in MiB (2**20 bytes); ``None`` for a single bucket per dtype; ``"auto"`` to
            predict the best cap from a short all-reduce microbenchmark at construction
            (``lightning_ddp.sync.bucket_model``; the prediction is kept in ``bucket_prediction``).
        process_group: The group to average over (default: the world).
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
        self.bucket_prediction: BucketPrediction | None = None
        if bucket_size_mb == "auto":
            # A collective: every rank measures together and gets the same (MAX-agreed) prediction.
            self.bucket_prediction = predict_bucket_size(self.params, process_group)
            bucket_size_mb = self.bucket_prediction.bucket_size_mb
        self.bucket_size_mb = bucket_size_mb
        cap = None if bucket_size_mb is None else int(bucket_size_mb * MiB)
        nbytes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = assign_buckets(nbytes, [p.dtype for p in self.params], cap)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._reset_step()

    def _reset_step(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = [len(bucket) for bucket in self.buckets]
        self._next_bucket = 0
        self._launched: list[Reduction] = []

    def _bucket_label(self, b: int) -> str:
        bucket = self.buckets[b]
        return self.param_names[bucket[0]] if len(bucket) == 1 else f"bucket {b} ({len(bucket)} tensors)"

    def _on_grad_ready(self, index: int) -> None:
        if self._ready[index]:
            raise RuntimeError(
                f"The gradient of {self.param_names[index]!r} became ready twice in one step. With gradient "
                "accumulation, run every micro-batch but the last under `with ddp.no_sync():`."
            )
        self._ready[index] = True
        self._pending[self._bucket_of[index]] -= 1
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        assert b == self._next_bucket == len(self._launched), "buckets must launch in order"
        params = [self.params[i] for i in self.buckets[b]]
        if len(params) == 1:  # reduced in its own shape, in place (slicing a 0-d tensor would fail)
            (param,) = params
            bucket = param.grad if param.grad is not None else torch.zeros_like(param)
        else:
            with self.comm.span("pack"):
                bucket = packed(params)
        self._launched.append(self.reduce.launch(self.comm, bucket, self._bucket_label(b)))
        self._next_bucket += 1

    def _synchronize(self) -> None:
        while self._next_bucket < len(self.buckets):
            self._launch(self._next_bucket)
        presence = launch_presence(self.comm, self.params, self.device)  # queued behind every bucket
        for bucket, reduction in zip(self.buckets, self._launched):
            average = reduction.wait()
            if len(bucket) == 1:  # reduced in place: .grad already holds it, unless the rank had none
                param = self.params[bucket[0]]
                if param.grad is None:
                    param.grad = average
                elif average.data_ptr() != param.grad.data_ptr():
                    param.grad.copy_(average)
            else:
                with self.comm.span("pack"):
                    unpack_gradients(average, [self.params[i] for i in bucket])
        for param, count in zip(self.params, read_presence(self.comm, presence)):
            if count == 0:  # no rank had a gradient: .grad = None, as in one process (the optimizer skips it)
                param.grad = None
        self._reset_step()
