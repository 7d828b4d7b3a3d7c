"""``Communicator``: an engine's (or optimizer's) async collectives on one process group; while a ``Recorder`` is armed,
named for the recording process groups, their waits and the critical path's spans recorded. ``backend_for``: which
backend of a spec such as ``cpu:gloo,cuda:nccl`` moves a device's tensors; ``gather_rank_states``: every rank's state
for a checkpoint (not recorded).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_ddp import compat
from lightning_ddp.sync.ranges import COMM_LAUNCH, COMM_WAIT
from lightning_ddp.sync.record import Recorder
from lightning_ddp.sync.recording_group import RecordingProcessGroup, record_process_groups

_NOTHING = nullcontext()


def profiler_range(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a torch profiler is recording, else a no-op (it costs tens of us)."""
    return record_function(name) if compat.profiler_enabled() else _NOTHING


_EVERY_DEVICE = "*"
_SPEC_FORM = "'<backend>' or '<device>:<backend>,<device>:<backend>', e.g. 'nccl' or 'cpu:gloo,cuda:nccl'"


def parse_backend_spec(spec: str) -> dict[str, str]:
    """``{device type: backend}`` of a backend spec, lower-cased; a plain name is ``{"*": name}``."""
    spec = str(spec).strip().lower()
    if ":" not in spec:
        if not spec or "," in spec:
            raise ValueError(f"backend spec {spec!r} is not of the form {_SPEC_FORM}")
        return {_EVERY_DEVICE: spec}
    backends: dict[str, str] = {}
    for pair in spec.split(","):
        device, sep, backend = (part.strip() for part in pair.partition(":"))
        if not (sep and device and backend) or ":" in backend:
            raise ValueError(f"backend spec {spec!r}: {pair.strip()!r} is not '<device>:<backend>'; use {_SPEC_FORM}")
        if device in backends:
            raise ValueError(f"backend spec {spec!r} names device {device!r} twice; give each device type one backend")
        backends[device] = backend
    return backends


def backend_from_spec(spec: str, device: torch.device | str) -> str | None:
    """The backend that moves ``device``'s tensors under ``spec``; ``None`` when the spec names none for it."""
    backends = parse_backend_spec(spec)
    return backends.get(torch.device(device).type, backends.get(_EVERY_DEVICE))


def backend_for(device: torch.device | str, group: dist.ProcessGroup | None = None) -> str:
    """The backend of ``group`` (default: the world) that moves ``device``'s tensors; ``ValueError`` if none."""
    config = dist.get_backend_config(group)
    backend = backend_from_spec(config, device)
    if backend is None:
        device_type = torch.device(device).type
        raise ValueError(
            f"the process group (backend {config!r}) has no backend for {device_type} tensors; move the tensors to a "
            f"device it serves, or initialise it with one for {device_type}, e.g. backend 'cpu:gloo,cuda:nccl'"
        )
    return backend


def require_process_group(user: str, strategy: str = "") -> None:
    """Raise ``RuntimeError`` naming ``user`` unless a default process group exists (``strategy`` makes one)."""
    if not dist.is_available() or not dist.is_initialized():
        also = f" (or train through {strategy}, which does it for you)." if strategy else ""
        raise RuntimeError(f"{user} needs a process group: call torch.distributed.init_process_group() first{also}")


class Communicator:
    """Async collectives on ``group`` (default: the world). With ``recorder`` set, each is issued under its label
    (the recording process group records it: ``sync/recording_group.py``), its wait recorded, and ``span`` records
    the critical path's synchronisation and packing."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._recorder: Recorder | None = None

    @property
    def recorder(self) -> Recorder | None:
        """Where this communicator's labels, waits and spans go, set by whoever measures; ``None``: nowhere."""
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | None) -> None:
        # A recorder attached here records every collective of the process's groups (issued through the recording
        # groups, ``record_process_groups``); the communicator issues on the recording one of its own group.
        self._recorder = recorder
        if recorder is None:
            return
        recording = record_process_groups(recorder)
        if self.group is not None and not isinstance(self.group, RecordingProcessGroup):
            self.group = next(group for group in recording if group.inner is self.group)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    # -- the collectives ---------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, label: str) -> dist.Work:
        """SUM all-reduce of ``tensor`` in place."""
        return self._launch(label, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group,
                                                           async_op=True))

    def reduce(self, tensor: torch.Tensor, owner: int, label: str) -> dist.Work:
        """SUM reduce of ``tensor`` to group rank ``owner`` (only the owner's copy holds the sum)."""
        dst = self.global_rank(owner)
        return self._launch(label, lambda: dist.reduce(tensor, dst=dst, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, owner: int, label: str) -> dist.Work:
        """Broadcast of ``tensor`` from group rank ``owner``."""
        src = self.global_rank(owner)
        return self._launch(label, lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, label: str) -> dist.Work:
        """SUM reduce-scatter: rank r's ``output`` is the sum of every rank's r-th chunk of ``input``."""
        return self._launch(label, lambda: compat.reduce_scatter_tensor(output, input, group=self.group,
                                                                        async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, label: str) -> dist.Work:
        """All-gather: ``output`` holds every rank's ``input``, in rank order."""
        return self._launch(label, lambda: compat.all_gather_tensor(output, input, group=self.group,
                                                                    async_op=True))

    def wait(self, work: dist.Work) -> None:
        """Block until ``work`` has finished (a recording group's work records the wait itself)."""
        with profiler_range(COMM_WAIT):
            work.wait()

    # -- spans on the critical path ----------------------------------------------------------------------

    def span(self, kind: str) -> AbstractContextManager:
        """Record the time inside as ``kind`` (``"exposed"`` or ``"pack"``); a no-op with no recorder attached."""
        recorder = self.recorder
        return self._span(kind) if recorder is not None and recorder.armed else _NOTHING

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

    def _launch(self, label: str, start: Callable[[], dist.Work]) -> dist.Work:
        recorder = self.recorder
        if recorder is None or not recorder.armed:  # nobody measures, or not this step
            with profiler_range(COMM_LAUNCH):
                return start()
        with recorder.naming(label), profiler_range(COMM_LAUNCH):
            return start()


class RecordsThroughComm:
    """For classes whose collectives go through ``self.comm``: their ``recorder`` is the communicator's."""

    comm: Communicator

    @property
    def recorder(self) -> Recorder | None:
        """Where the collectives are recorded; ``None`` (the default): nowhere, at no cost."""
        return self.comm.recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | None) -> None:
        self.comm.recorder = recorder


def gather_rank_states(
    state: Any, comm: Communicator, device: torch.device | str, dst: int | None = None
) -> list[Any] | None:
    """``[state of rank 0, state of rank 1, ...]`` (copies, tensors on CPU); a collective: one ``all_gather_object``
    of the skeletons (tensors replaced by meta tensors: shape and dtype), then one ``broadcast`` per tensor.

    ``device``: where tensors travel. With ``dst`` only that group rank gets the list; the others get ``None``.
    """
    skeleton = compat.map_tensors(lambda tensor: tensor.detach().to("meta"), state)
    skeletons: list[Any] = [None] * comm.world_size
    dist.all_gather_object(skeletons, skeleton, group=comm.group)
    keep = dst is None or dst == comm.rank
    device = torch.device(device)
    own = iter(compat.tensors_of(state))
    states = []
    for r, rank_skeleton in enumerate(skeletons):

        def receive(spec: torch.Tensor) -> torch.Tensor | None:
            if r == comm.rank:
                buffer = next(own).detach().to(device, copy=True)
            else:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.broadcast(buffer, src=comm.global_rank(r), group=comm.group)
            return buffer.cpu() if keep else None

        received = compat.map_tensors(receive, rank_skeleton)  # in the skeleton's order on every rank
        if keep:
            states.append(received)
    return states if keep else None
