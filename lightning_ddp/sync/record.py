"""What every gradient-sync engine records about its communication, once per optimizer step.

The engines (``NaiveDDP``, ``FlatDDP``, ``OverlapDDP``, ``BucketedDDP``) only *record*; the timing callback
(``lightning_ddp.callbacks``) turns a record into metrics. Keeping the two apart lets the accounting be
unit-tested with hand-made timelines.

Clocks (the honesty rules):

- On CPU a mark is ``time.perf_counter()``: collectives run on the host, so the host clock is the truth.
- On CUDA a mark is a ``torch.cuda.Event`` recorded on the current stream. The host runs ahead of the GPU,
  so host time says when work was *queued*, not when it ran; an event says when the stream reached it. Marks
  are converted to milliseconds only after the step, when ``StepClock.to_ms`` can read finished events.
- ``StepClock.start()`` synchronises the device once per optimizer step (CUDA only) and anchors the two
  clocks: host time ``t0`` and event ``e0`` describe the same instant, so a host time measured by a
  communication thread (gloo's completion callbacks) and an event time land on one axis.
- When an async collective *completed*: gloo completes its ``Work`` future on its own thread when the data
  has arrived, so a ``then`` callback reads the host clock at completion. NCCL completes the future when the
  work is queued, so for NCCL we use ``Work._get_duration()`` (set ``TORCH_NCCL_ENABLE_TIMING=1``) added to
  the launch mark, and otherwise the mark after ``wait()`` (an upper bound, exact when the wait blocked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class StepClock:
    """Time marks on one axis per optimizer step: host seconds on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.e0: torch.cuda.Event | None = None

    def start(self) -> None:
        """Open a step: on CUDA wait for queued work so that ``t0`` and ``e0`` name the same instant."""
        if self.cuda:
            torch.cuda.synchronize()
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e0.record()
        self.t0 = time.perf_counter()

    def mark(self) -> Mark:
        """Now, as the device sees it (an event on the current stream on CUDA, host time on CPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def to_ms(self, mark: Mark) -> float:
        """Milliseconds from the step's start to ``mark``. On CUDA, call after the events have completed."""
        if isinstance(mark, float):
            return (mark - self.t0) * 1e3
        assert self.e0 is not None, "StepClock.start() was not called before CUDA events were recorded"
        return self.e0.elapsed_time(mark)


@dataclass
class Collective:
    """One gradient collective (e.g. the all-reduce of one bucket)."""

    op: str
    """Collective kind: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``."""
    label: str
    """What was communicated: a parameter name, ``bucket 3 (12 tensors)``, ``flat (435 tensors)``."""
    nbytes: int
    """Bytes of the local input tensor (the message size of nccl-tests)."""
    launched: Mark
    """When the collective was issued."""
    completed: Mark | None = None
    """When its result was available (see the module docstring for how, per backend)."""
    duration_ms: float | None = None
    """NCCL's own measurement of the collective's kernel time, when ``TORCH_NCCL_ENABLE_TIMING=1``."""
    wait: tuple[Mark, Mark] | None = None
    """The interval the caller spent in ``Work.wait()`` for it."""


@dataclass
class SyncRecord:
    """Everything one optimizer step communicated, and how long the critical path waited for it."""

    collectives: list[Collective] = field(default_factory=list)
    exposed: list[tuple[Mark, Mark]] = field(default_factory=list)
    """Intervals on the critical path spent synchronising gradients (``finish_gradient_synchronization``)."""
    pack: list[tuple[Mark, Mark]] = field(default_factory=list)
    """Intervals spent copying gradients into and out of communication buffers (flat, bucketed). On the critical
    path and inside ``exposed`` when they happen there; the accounting subtracts them from it."""

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)
