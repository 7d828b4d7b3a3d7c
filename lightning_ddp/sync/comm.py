"""``Communicator``: the collectives of one engine (or optimizer) on one process group, in one place.

Every collective the engines and ZeRO-1 issue goes through here, so that three concerns are handled once:

- **async launch and wait**: each method launches ``async_op=True`` and returns a ``Pending``; ``wait(pending)``
  blocks for it;
- **recording**, only when a ``Recorder`` is attached (``communicator.recorder``); with none attached a
  collective costs one ``is None`` check more than calling ``torch.distributed`` directly;
- **profiler ranges** (``ddp/comm_launch``, ``ddp/comm_wait``; names in ``lightning_ddp.sync.ranges``), only
  while a torch profiler records.

Message sizes follow nccl-tests (what ``Collective.nbytes`` holds, and what bus bandwidth is computed from): the
buffer for ``all_reduce``, ``reduce`` and ``broadcast``; the whole input of ``reduce_scatter`` and the whole
output of ``all_gather`` (every rank's part).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_ddp import compat
from lightning_ddp.sync.ranges import COMM_LAUNCH, COMM_WAIT
from lightning_ddp.sync.record import Collective, Recorder

__all__ = ["Communicator", "Pending", "RecordsThroughComm", "profiler_range"]

_NOTHING = nullcontext()


@dataclass
class Pending:
    """An issued collective: its ``Work`` and, when recorded, its ``Collective``."""

    work: dist.Work
    collective: Collective | None = None


def profiler_range(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a torch profiler is recording, else a no-op context.

    Why the check: entering a ``record_function`` dispatches an op that allocates a ``RecordFunction`` even when
    no profiler listens (20-40 us per range on our CPU machines); the flag read costs ~0.1 us, so
    per-collective ranges are free when nobody profiles.
    """
    return record_function(name) if compat.profiler_enabled() else _NOTHING


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Communicator:
    """Async collectives on ``group`` (default: the world), recorded when ``recorder`` is set.

    Args:
        group: The process group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.recorder: Recorder | None = None
        """Set by whoever measures (see ``lightning_ddp.sync.record``); ``None``: record nothing."""

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    # -- the collectives ---------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, label: str) -> Pending:
        """SUM all-reduce of ``tensor`` in place."""
        return self._launch("all_reduce", label, _nbytes(tensor),
                            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def reduce(self, tensor: torch.Tensor, owner: int, label: str) -> Pending:
        """SUM reduce of ``tensor`` to group rank ``owner`` (only the owner's copy holds the sum)."""
        dst = self.global_rank(owner)
        return self._launch("reduce", label, _nbytes(tensor),
                            lambda: dist.reduce(tensor, dst=dst, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, owner: int, label: str) -> Pending:
        """Broadcast of ``tensor`` from group rank ``owner``."""
        src = self.global_rank(owner)
        return self._launch("broadcast", label, _nbytes(tensor),
                            lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, label: str) -> Pending:
        """SUM reduce-scatter: rank r's ``output`` is the sum of every rank's r-th chunk of ``input``."""
        return self._launch("reduce_scatter", label, _nbytes(input),
                            lambda: compat.reduce_scatter_tensor(output, input, group=self.group, async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, label: str) -> Pending:
        """All-gather: ``output`` holds every rank's ``input``, in rank order."""
        return self._launch("all_gather", label, _nbytes(output),
                            lambda: compat.all_gather_tensor(output, input, group=self.group, async_op=True))

    def wait(self, pending: Pending) -> None:
        """Block until ``pending`` has finished (recording the wait when it is recorded)."""
        recorder = self.recorder if pending.collective is not None else None
        start = recorder.mark() if recorder is not None else None
        with profiler_range(COMM_WAIT):
            pending.work.wait()
        if recorder is not None:
            pending.collective.wait = (start, recorder.mark())

    # -- spans on the critical path ----------------------------------------------------------------------

    def span(self, kind: str) -> AbstractContextManager:
        """Record the time inside as ``kind`` (``"exposed"`` or ``"pack"``); a no-op with no recorder attached."""
        return self._span(kind) if self.recorder is not None else _NOTHING

    @contextmanager
    def _span(self, kind: str) -> Iterator[None]:
        recorder = self.recorder
        assert recorder is not None
        recorder.ensure_open()
        start = recorder.mark()
        try:
            yield
        finally:
            recorder.span(kind, start)

    # -- internals ---------------------------------------------------------------------------------------

    def _launch(self, op: str, label: str, nbytes: int, start: Callable[[], dist.Work]) -> Pending:
        recorder = self.recorder
        if recorder is None:
            with profiler_range(COMM_LAUNCH):
                return Pending(start())
        recorder.ensure_open()
        collective = Collective(op, label, nbytes, recorder.mark())
        with profiler_range(COMM_LAUNCH):
            work = start()
        recorder.add(collective, work, device_completion=recorder.clock.cuda and self.backend == "nccl")
        return Pending(work, collective)


class RecordsThroughComm:
    """For classes that issue their collectives through ``self.comm`` (engines, ``ShardedOptimizer``): the
    ``recorder`` an observer attaches is the communicator's."""

    comm: Communicator

    @property
    def recorder(self) -> Recorder | None:
        """Where the collectives are recorded; ``None`` (the default): nowhere, at no cost."""
        return self.comm.recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | None) -> None:
        self.comm.recorder = recorder
