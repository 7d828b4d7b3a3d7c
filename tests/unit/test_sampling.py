"""What the CommTimer measures and when (issue 23, items 4-5), in one process: the Recorder's armed flag on every
recording path, the timer's ``every_n_steps`` and its errors, and the one place that decides how much of a
strategy's communication can be measured (``recording.comm_recording``) with the message for the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.metrics.recording import comm_recording, measurement_note
from lightning_ddp.sync import BucketedDDP, NaiveDDP, Recorder
from lightning_ddp.sync.record import StepClock


class CountingClock(StepClock):
    """The CPU clock, counting its reads and synchronizations."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.marks = self.syncs = 0

    def mark(self):
        self.marks += 1
        return super().mark()

    def synchronize(self) -> None:
        self.syncs += 1


def _step(engine: nn.Module, model: nn.Module) -> None:
    engine.on_train_batch_start()
    engine(torch.randn(3, 4)).sum().backward()
    engine.finish_gradient_synchronization()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("engine_class", [NaiveDDP, BucketedDDP])
def test_an_unarmed_recorder_records_nothing_on_any_path(world_of_one, engine_class) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = engine_class(model)
    clock = CountingClock()
    recorder = Recorder(clock=clock, open_on_demand=False)  # as under Lightning: armed only in opened steps
    engine.recorder = recorder
    recorder.watch_gradients(list(model.parameters()))
    assert not recorder.armed
    _step(engine, model)  # nobody opened this step: collectives, spans and gradient hooks all return at once
    recorder.mark_backward_started()
    recorder.mark_gradients_usable()
    assert (clock.marks, clock.syncs, recorder.record.collectives, recorder.is_open) == (0, 0, [], False)

    recorder.open_step(1)  # a measured step: everything is recorded, and the recorder is unarmed again after it
    assert recorder.armed
    _step(engine, model)
    record = recorder.finish_step()
    assert not recorder.armed and clock.syncs == 1 and record.collectives
    assert all(mark is not None for mark in record.ready)  # 4 gradients, each marked when computed
    marks = clock.marks
    _step(engine, model)
    assert clock.marks == marks and clock.syncs == 1  # after the measured step: nothing again


def test_a_recorder_on_its_own_still_opens_steps_on_demand(world_of_one) -> None:
    # The default (benchmarks, tests, a user measuring an engine without Lightning): the first collective opens one.
    model = nn.Linear(4, 1)
    engine = NaiveDDP(model)
    engine.recorder = recorder = Recorder()
    assert recorder.armed
    _step(engine, model)
    assert recorder.is_open and len(recorder.finish_step().collectives) >= 2  # weight, bias (and the flags)
    assert recorder.armed


@pytest.mark.parametrize(("value", "error"), [
    (0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError),
])
def test_every_n_steps_must_be_a_positive_int_and_the_error_names_the_flag(value, error) -> None:
    with pytest.raises(error, match=r"--timer.every_n_steps 1"):
        CommTimer(every_n_steps=value)


def test_a_step_is_sampled_iff_its_number_is_a_multiple_of_every_n_steps() -> None:
    timer = CommTimer(every_n_steps=3)
    timer._every = 3  # what on_train_start resolves (the given value, or the trainer's log_every_n_steps)
    assert [s for s in range(10) if timer.observes(s)] == [0, 3, 6, 9]


def test_what_each_strategy_lets_the_timer_measure() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    from lightning_ddp.strategies import GradSyncStrategy, ZeRO1DDPStrategy

    assert comm_recording(GradSyncStrategy(algorithm="bucketed_ddp")) == "full"
    assert comm_recording(ZeRO1DDPStrategy()) == "full"
    assert comm_recording(DDPStrategy()) == "full"  # torch DDP, through a recording comm hook
    single, fsdp = SingleDeviceStrategy(device="cpu"), FSDPStrategy()
    assert comm_recording(single) is None and comm_recording(fsdp) is None

    class Landmarks:  # a strategy that declares it (e.g. an FSDP2 of ours: exposed time from the landmarks only)
        comm_recording = "landmarks"

    assert comm_recording(Landmarks()) == "landmarks"
    Landmarks.comm_recording = "some"
    with pytest.raises(ValueError, match="declare one of 'full', 'landmarks', None"):
        comm_recording(Landmarks())

    # one line each, saying what is measured and what is not; nothing for "full"
    assert measurement_note(DDPStrategy(), "full", 2) is None
    one = measurement_note(single, None, 1)
    assert "(one device)" in one and "step time" in one and "no gradient communication" in one
    sharded = measurement_note(fsdp, None, 2)
    # named as Lightning registers it (FSDPStrategy.strategy_name)
    assert sharded.startswith("CommTimer cannot record fsdp's communication") and "step time" in sharded
    assert "comm/* metrics" in sharded and "\n" not in sharded
    landmarks = measurement_note(Landmarks(), "landmarks", 2)
    assert "comm/exposed_ms" in landmarks and "comm/busy_ms, comm/overlap" in landmarks
