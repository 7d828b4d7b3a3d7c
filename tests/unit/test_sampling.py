"""What the CommTimer measures and when (issue 23, items 4-5), in one process: the Recorder's armed flag on every
recording path, the timer's ``every_n_steps`` and its errors, and the one place that decides how much of a
run's communication is measured (``recording.comm_recording``), with the message for a run without any."""

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


def test_what_the_timer_measures_of_a_run(world_of_one) -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    # Every collective of a run with a process group, whatever its strategy (recorded at the process group), at
    # world size 1 too (NCCL on one GPU: the accounting's every line runs)
    assert comm_recording() == "full"
    single = SingleDeviceStrategy(device="cpu")
    assert measurement_note(single, "full") is None
    one = measurement_note(single, None)
    assert "(one device)" in one and "step time" in one and "no gradient communication" in one and "\n" not in one


def test_without_a_process_group_nothing_is_recorded() -> None:
    assert comm_recording() is None  # no init_process_group (one device): no group to record at


def test_a_short_run_is_sampled_often_enough_for_a_summary() -> None:
    from lightning_ddp.callbacks.comm_timer import MIN_SUMMARY_STEPS, default_every_n_steps

    # A 30-step script under Lightning's default log_every_n_steps=50 would measure step 0 only: every 30 //
    # (5 warm-up + 10) = 2nd step instead, 15 measured, 10 of them after the warm-up.
    assert default_every_n_steps(50, planned_steps=30, warmup_steps=5) == 2
    assert len(range(0, 30, 2)) - 5 == MIN_SUMMARY_STEPS
    assert default_every_n_steps(50, planned_steps=100_000, warmup_steps=5) == 50  # a long run: Lightning's cadence
    assert default_every_n_steps(50, planned_steps=None, warmup_steps=5) == 50  # unknown length: the same
    assert default_every_n_steps(50, planned_steps=3, warmup_steps=5) == 1  # shorter than the warm-up: every step


def test_a_run_without_a_summary_says_what_ran_and_what_changes_it(monkeypatch) -> None:
    from lightning_ddp.callbacks import comm_timer

    timer = CommTimer(warmup_steps=5)
    timer._every = 50
    timer.summary.add(0, {"step/time_ms": 10.0})
    monkeypatch.setattr(comm_timer, "_launched_by_cli", lambda: False)
    script = timer._no_summary_message(steps_run=30)
    assert script.startswith("CommTimer: 30 optimizer steps ran and 1 of them were measured (one step in 50)")
    assert "CommTimer(every_n_steps=...)" in script and "CommTimer(warmup_steps=...)" in script
    assert "--timer" not in script
    monkeypatch.setattr(comm_timer, "_launched_by_cli", lambda: True)
    cli = timer._no_summary_message(steps_run=30)
    assert "--timer.every_n_steps" in cli and "--timer.warmup_steps" in cli and "CommTimer(" not in cli


def test_a_ddp_comm_hook_lightning_drops_off_cuda_is_said_once() -> None:
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_ddp.callbacks.comm_timer import _dropped_comm_hook_note

    strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, parallel_devices=[torch.device("cpu")] * 2)
    note = _dropped_comm_hook_note(strategy)
    assert "ddp_comm_hook=fp16_compress_hook) is not applied on cpu" in note and "uncompressed" in note
    assert _dropped_comm_hook_note(DDPStrategy(parallel_devices=[torch.device("cpu")] * 2)) is None  # no hook
    on_gpu = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, parallel_devices=[torch.device("cuda", 0)])
    assert _dropped_comm_hook_note(on_gpu) is None  # Lightning registers it on CUDA: nothing dropped
