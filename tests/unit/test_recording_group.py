"""The recording process group in one process (a gloo world of one): it stands in for the original group in torch's
registry with its backends, name and bound device, records only while armed, leaves the original usable by whoever
holds it, and withdraws."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ddp.sync.record import Recorder
from lightning_ddp.sync.recording_group import RecordingProcessGroup, record_process_groups, stop_recording_process_groups


def test_it_takes_the_groups_place_and_gives_it_back(world_of_one) -> None:
    original = dist.group.WORLD
    original.bound_device_id = torch.device("cpu", 0)  # as Lightning's eager NCCL init sets it (here: any device)
    recorder = Recorder(open_on_demand=False)
    (recording,) = record_process_groups(recorder)
    assert dist.group.WORLD is recording and recording.inner is original and recording.label == "world"
    # what code reads of a group is the original's: backend, name, ranks, bound device (NCCL's eager init)
    assert dist.get_backend() == "gloo" and recording.name() == "gloo" and recording._get_backend_name() == "gloo"
    assert recording.group_name == original.group_name and recording.bound_device_id == torch.device("cpu", 0)
    assert dist.get_rank(recording) == 0 and dist.get_world_size(recording) == 1
    assert record_process_groups(recorder) == [recording]  # a second call wraps nothing twice
    tensor = torch.ones(3)
    dist.all_reduce(tensor)  # not armed: issued, not recorded
    assert recorder.record.collectives == []
    recorder.open_step(0)
    dist.all_reduce(tensor)
    from torch.distributed import _functional_collectives as functional  # resolves the group by its name

    functional.wait_tensor(functional.all_reduce(tensor, "sum", recording.group_name))
    record = recorder.finish_step()
    assert [(c.op, c.nbytes, c.group) for c in record.collectives] == [("all_reduce", 12, "world")] * 2
    stop_recording_process_groups()
    assert dist.group.WORLD is original and recording.recorder is None


def test_code_holding_the_original_group_keeps_using_it(world_of_one) -> None:
    original = dist.group.WORLD
    recorder = Recorder()
    record_process_groups(recorder)
    recorder.open_step(0)
    # what a user's code or module asks of the group it holds (the CI failure: "not initialized in the world group
    # map" when the stand-in took the original's place instead of standing beside it)
    assert dist.get_backend(original) == "gloo" and dist.get_rank(original) == 0
    assert dist.get_world_size(original) == 1 and dist.get_process_group_ranks(original) == [0]
    dist.all_reduce(torch.ones(2), group=original)  # runs, on the original: not recorded
    assert recorder.finish_step().collectives == []
    stop_recording_process_groups()
    assert dist.get_backend(original) == "gloo"


def test_a_wait_is_recorded_on_the_work_handed_back(world_of_one) -> None:
    recorder = Recorder()
    record_process_groups(recorder)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    assert isinstance(work, dist.Work) and work.wait()
    (collective,) = recorder.finish_step().collectives
    assert collective.wait is not None and collective.wait[0] <= collective.wait[1]
    stop_recording_process_groups()


def test_an_engine_given_a_group_issues_on_its_recording_one(world_of_one) -> None:
    from lightning_ddp.sync import NaiveDDP

    engine = NaiveDDP(torch.nn.Linear(2, 1), process_group=dist.group.WORLD)
    engine.recorder = recorder = Recorder()  # records the process's groups, the engine's among them
    assert isinstance(engine.comm.group, RecordingProcessGroup)
    engine.on_train_batch_start()
    engine(torch.ones(1, 2)).sum().backward()
    engine.finish_gradient_synchronization()
    labels = [c.label for c in recorder.finish_step().collectives]
    assert labels == ["gradient presence flags", "weight", "bias"]  # the engine's names for its collectives
    stop_recording_process_groups()


def test_a_barrier_in_a_measured_step_is_recorded_and_accounted(world_of_one) -> None:
    # Lightning calls the strategy's barrier while it restores a checkpoint: the timer must account it (0 bytes, no
    # bus bandwidth), not fail the fit (it did: "no bus-bandwidth factor for collective 'barrier'").
    from lightning_ddp.metrics.accounting import StepTiming, step_metrics

    recorder = Recorder()
    record_process_groups(recorder)
    recorder.open_step(0)
    dist.barrier()
    record = recorder.finish_step()
    assert [(c.op, c.nbytes) for c in record.collectives] == [("barrier", 0)]
    metrics = step_metrics(StepTiming.from_record(record, step_ms=10.0, tokens=None), world_size=1)
    assert metrics["comm/calls"] == 1 and metrics["comm/bytes"] == 0
    stop_recording_process_groups()
