"""Every collective of this process, whoever issues it, recorded where they all pass: the process group.

``record_process_groups(recorder)`` registers a ``RecordingProcessGroup`` as the stand-in for each process group torch
has registered (the world, a ``DeviceMesh``'s subgroups, any ``new_group``): our engines, torch DDP's reducer, a user's
comm hook, FSDP2's all-gathers and reduce-scatters and HSDP's all-reduce then issue their collectives through it.
It runs each one on the group's own backends (gloo, NCCL: no new connection, the same calls in the same order) and,
while the recorder is armed, records it; otherwise it costs one check. ``stop_recording_process_groups()``
withdraws the stand-ins. Why at the process group, what it cannot see and what it costs: ``docs/comm_timer.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ddp import compat
from lightning_ddp.sync.record import Collective, Recorder

WORLD = "world"
"""The group label of the default process group."""


def group_label(description: str, ranks: Sequence[int], is_world: bool) -> str:
    """What the summary calls a process group: ``world``, a mesh dimension's name (torch describes a
    ``DeviceMesh``'s groups as ``mesh_<dim>``), else its own description, else its global ranks.

    >>> group_label("mesh_dp_shard", [0, 1], False), group_label("undefined", [0, 2], False)
    ('dp_shard', 'ranks 0,2')
    """
    if is_world:
        return WORLD
    if description.startswith("mesh_"):
        return description.removeprefix("mesh_")
    if description and description not in ("undefined", "default_pg"):
        return description
    return "ranks " + ",".join(map(str, ranks))


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(tensor.nbytes for tensor in tensors)


class Launch(NamedTuple):
    """A recorded collective between its launch and its issue."""

    recorder: Recorder
    collective: Collective
    device_completion: bool  # its completion is a CUDA event (NCCL), else a host time


class RecordingProcessGroup(dist.ProcessGroup):
    """A process group that issues every collective on ``inner``'s backends and records it while ``recorder`` is
    armed. ``nbytes`` follows nccl-tests: the buffer; the whole input of a reduce-scatter, output of an all-gather.

    Methods named here are what ``torch.distributed`` (and, through pybind's ``PyProcessGroup``, C++ callers such as
    DDP's reducer) call on a group; both spellings of torch 2.13's renames are covered. Anything else (send, recv,
    gather, scatter, a method C++ reaches only on the base class) runs on the same backends unrecorded.
    """

    def __init__(self, inner: dist.ProcessGroup, label: str) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.label = label
        self.recorder: Recorder | None = None
        """Where collectives go while it is armed; ``None``: recorded nowhere, at the cost of one check."""
        compat.share_backends(inner, self)  # the group's own backends: collectives run exactly as they would
        self._nccl: dict[str, bool] = {}  # device type -> whether NCCL moves its tensors (asked once)

    def getBackendName(self) -> str:  # noqa: N802  (torch's name for the method pybind forwards to)
        return self.inner.name()

    def _moved_by_nccl(self, device: torch.device) -> bool:
        moved = self._nccl.get(device.type)
        if moved is None:
            moved = self._nccl[device.type] = compat.backend_name(self, device) == "nccl"
        return moved

    def _launch(self, op: str, nbytes: int, device: torch.device) -> Launch | None:
        """A collective about to be issued on ``device``'s tensors, recorded as launched now; ``None`` in a step
        nobody measures (the one check)."""
        recorder = self.recorder
        if recorder is None or not recorder.armed:
            return None
        # NCCL: completion is a device event; gloo (CPU or CUDA tensors): the host clock when the data has arrived.
        device_completion = recorder.clock.cuda and self._moved_by_nccl(device)
        return Launch(recorder, recorder.launch(op, nbytes, self.label), device_completion)

    @staticmethod
    def _issued(launch: Launch | None, work: Any) -> Any:
        """``work`` of the collective just issued, its completion recorded where it was launched recorded."""
        if launch is None:
            return work
        return launch.recorder.issued(launch.collective, work, device_completion=launch.device_completion)

    # -- the collectives: each issued by ``inner`` itself. Not by ``super()``: torch's trampoline for Python
    # groups (``PyProcessGroup``) calls the base class's method while holding the GIL, and a gloo worker that frees
    # a finished work needs the GIL while it holds the queue's lock: the next launch would wait forever. -----------

    def allreduce(self, tensors: list[Tensor], opts: Any) -> Any:
        launch = self._launch("all_reduce", _nbytes(tensors), tensors[0].device)
        return self._issued(launch, self.inner.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any) -> Any:
        launch = self._launch("all_reduce", _nbytes(tensors), tensors[0].device)
        return self._issued(launch, self.inner.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors: list[Tensor], opts: Any) -> Any:
        launch = self._launch("broadcast", _nbytes(tensors), tensors[0].device)
        return self._issued(launch, self.inner.broadcast(tensors, opts))

    def reduce(self, tensors: list[Tensor], opts: Any) -> Any:
        launch = self._launch("reduce", _nbytes(tensors), tensors[0].device)
        return self._issued(launch, self.inner.reduce(tensors, opts))

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any) -> Any:
        nbytes = sum(_nbytes(outputs) for outputs in output_lists)
        launch = self._launch("all_gather", nbytes, inputs[0].device)
        return self._issued(launch, self.inner.allgather(output_lists, inputs, opts))

    def allgather_coalesced(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any) -> Any:
        nbytes = sum(_nbytes(outputs) for outputs in output_lists)
        launch = self._launch("all_gather", nbytes, inputs[0].device)
        return self._issued(launch, self.inner.allgather_coalesced(output_lists, inputs, opts))

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any) -> Any:  # torch >= 2.13
        launch = self._launch("all_gather", output.nbytes, output.device)
        return self._issued(launch, self.inner.all_gather_single(output, input, opts))

    def _allgather_base(self, output: Tensor, input: Tensor, opts: Any) -> Any:  # torch <= 2.12
        launch = self._launch("all_gather", output.nbytes, output.device)
        return self._issued(launch, self.inner._allgather_base(output, input, opts))

    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> Any:
        launch = self._launch("all_gather", _nbytes(outputs), outputs[0].device)
        return self._issued(launch, self.inner.all_gather_single_coalesced(outputs, inputs, opts))

    def allgather_into_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> Any:
        launch = self._launch("all_gather", _nbytes(outputs), outputs[0].device)
        return self._issued(launch, self.inner.allgather_into_tensor_coalesced(outputs, inputs, opts))

    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any) -> Any:
        nbytes = sum(_nbytes(inputs) for inputs in input_lists)
        launch = self._launch("reduce_scatter", nbytes, outputs[0].device)
        return self._issued(launch, self.inner.reduce_scatter(outputs, input_lists, opts))

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any) -> Any:  # torch >= 2.13
        launch = self._launch("reduce_scatter", input.nbytes, input.device)
        return self._issued(launch, self.inner.reduce_scatter_single(output, input, opts))

    def _reduce_scatter_base(self, output: Tensor, input: Tensor, opts: Any) -> Any:  # torch <= 2.12
        launch = self._launch("reduce_scatter", input.nbytes, input.device)
        return self._issued(launch, self.inner._reduce_scatter_base(output, input, opts))

    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> Any:
        launch = self._launch("reduce_scatter", _nbytes(inputs), inputs[0].device)
        return self._issued(launch, self.inner.reduce_scatter_single_coalesced(outputs, inputs, opts))

    def reduce_scatter_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> Any:
        launch = self._launch("reduce_scatter", _nbytes(inputs), inputs[0].device)
        return self._issued(launch, self.inner.reduce_scatter_tensor_coalesced(outputs, inputs, opts))

    def all_to_all_single(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                          opts: Any) -> Any:  # torch >= 2.13
        launch = self._launch("all_to_all", input.nbytes, input.device)
        return self._issued(launch, self.inner.all_to_all_single(output, input, output_splits, input_splits, opts))

    def alltoall_base(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                      opts: Any) -> Any:  # torch <= 2.12
        launch = self._launch("all_to_all", input.nbytes, input.device)
        return self._issued(launch, self.inner.alltoall_base(output, input, output_splits, input_splits, opts))

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> Any:
        launch = self._launch("all_to_all", _nbytes(inputs), inputs[0].device)
        return self._issued(launch, self.inner.alltoall(outputs, inputs, opts))

    def barrier(self, opts: Any) -> Any:
        only_cuda = compat.device_types(self.inner) == ["cuda"]
        launch = self._launch("barrier", 0, torch.device("cuda" if only_cuda else "cpu"))
        return self._issued(launch, self.inner.barrier(opts))

    # -- what torch's trampoline would also run holding the GIL: passed to ``inner`` unrecorded ---------------------

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Any:
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Any:
        return self.inner.recv(tensors, src, tag)

    def start_coalescing(self, device: torch.device) -> None:
        compat.start_coalescing(self.inner, device)

    def end_coalescing(self, device: torch.device) -> Any:
        return compat.end_coalescing(self.inner, device)


def record_process_groups(recorder: Recorder) -> list[RecordingProcessGroup]:
    """Record every collective of this process's groups into ``recorder`` from now on (each armed step): a
    ``RecordingProcessGroup`` over each group's backends stands in for it in torch's registry (once; a later call
    only points them at ``recorder``). The original stays registered for code that holds it, and what it issues
    itself (a DDP model built earlier) is not recorded: call this after ``init_process_group`` and before wrapping
    the model. Returns the recording groups."""
    groups = compat.process_groups()
    stand_ins = {group.inner: group for group in groups if isinstance(group, RecordingProcessGroup)}
    for group in groups:
        if isinstance(group, RecordingProcessGroup) or group in stand_ins:
            continue
        label = group_label(group.group_desc, dist.get_process_group_ranks(group), group is compat.world_group())
        stand_ins[group] = RecordingProcessGroup(group, label)
        compat.register_stand_in(group, stand_ins[group])
    recording = list(stand_ins.values())
    for group in recording:
        group.recorder = recorder
    return recording


def stop_recording_process_groups() -> None:
    """Withdraw every stand-in ``record_process_groups`` registered; what holds a recording group (a DDP model,
    FSDP2's state) keeps it, recording nothing."""
    for group in compat.process_groups():
        if isinstance(group, RecordingProcessGroup):
            group.recorder = None
            compat.unregister_stand_in(group.inner, group)
