"""The CUDA/NCCL accounting paths, checked on CPU: fake clocks and events stand in for the GPU, a fake ``Work``
for NCCL's future, a fake all-reduce for the other rank. The GPU itself runs these paths in the ``cuda`` tests.

- a collective's completion: NCCL's future callback records an event (on the callback's stream, which waits for
  the kernel); gloo's reads the host clock; a recorded completion is never replaced by the end of a wait;
- the backend is decided per tensor device from the group's spec (``cpu:gloo,cuda:nccl``), never by comparing the
  spec with "nccl": the communicator's completions, ZeRO-1's ``collectives: auto``, the bucket model's default
  device and the strategy's check all ask ``backend_for`` / ``backend_from_spec``;
- one synchronize per measured step, and the next step anchored on it for free;
- a measurement never ends a run: marks that contradict each other (two clocks) are clamped, counted in
  ``comm/clock_anomalies`` and the summary, and warned about once per run;
- the division by the world size happens before launch (pre-scaling), in every engine;
- the bucketed engine reads the gradient-presence flags last;
- every copy and scaling of gradients is a ``pack`` span, wherever it runs;
- ZeRO-1's reduce-scatter schedule refuses fp16's GradScaler (it would hang), the RoPE angles stay fp32 under a
  bf16 cast, and GPU traces take compute from kernels.
"""

from __future__ import annotations

import copy
import gc
import inspect
import json
import math
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp import catalogue
from lightning_ddp.metrics.accounting import (
    METRIC_KEYS,
    ClockAnomalyWarning,
    StepTiming,
    TimingSummary,
    step_metrics,
)
from lightning_ddp.sync import Collective, Recorder
from lightning_ddp.sync.bucketed_bf16 import BF16CompressedAllReduce
from lightning_ddp.sync import comm as comm_module
from lightning_ddp.sync.record import StepClock, SyncRecord

# ---- fakes --------------------------------------------------------------------------------------------------


class FakeEvent:
    """A CUDA event: the fake device time at which it was recorded."""

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms


class FakeCudaClock(StepClock):
    """A StepClock on a pretend GPU: ``mark()`` is an event at the fake device time, host time runs alongside."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.cuda = True
        self.now_ms = 0.0  # the fake device clock, moved by the test
        self.synchronizes = 0

    def synchronize(self) -> None:
        self.synchronizes += 1

    def anchor(self, synchronize: bool = True) -> None:
        if synchronize:
            self.synchronize()
        self.e0 = FakeEvent(self.now_ms)
        self.t0 = 1000.0 + self.now_ms / 1e3  # the host clock reads 1000 s at device time 0

    def mark(self) -> FakeEvent:
        return FakeEvent(self.now_ms)

    def host_time(self) -> float:
        return 1000.0 + self.now_ms / 1e3

    def to_ms(self, mark) -> float:
        if isinstance(mark, float):
            return (mark - self.t0) * 1e3
        return mark.t_ms - self.e0.t_ms


class FakeFuture:
    def __init__(self) -> None:
        self.callbacks = []
        self.completed = False

    def then(self, callback) -> CallbackFuture:
        self.callbacks.append(callback)
        return CallbackFuture(self, callback)

    def done(self) -> bool:
        return self.completed

    def complete(self) -> None:
        self.completed = True
        for callback in self.callbacks:
            callback(self)


class CallbackFuture:
    """What ``then`` returns: done once its callback ran. Its ``wait`` runs a callback still pending, as a waiting
    thread that lets go of the GIL lets the backend's thread run it."""

    def __init__(self, parent: FakeFuture, callback) -> None:
        self.parent, self.callback = parent, callback

    def wait(self) -> None:
        self.callback(self.parent)


class FakeWork:
    def __init__(self) -> None:
        self.future = FakeFuture()

    def get_future(self) -> FakeFuture:
        return self.future

    def wait(self) -> bool:
        return True


# ---- completion and the step's synchronize ------------------------------------------------------------------


@pytest.mark.parametrize("device_completion", [True, False], ids=["nccl", "gloo"])
def test_completion_comes_from_the_future_callback_and_is_never_replaced(device_completion: bool) -> None:
    clock = FakeCudaClock()
    recorder = Recorder(clock=clock)
    recorder.open_step(0)
    clock.now_ms = 10.0
    collective = recorder.launch("all_reduce", 4096, "world")
    work = FakeWork()
    handed = recorder.issued(collective, work, device_completion=device_completion)
    assert handed.work is work and handed.get_future() is work.future  # the caller's work, its future its own
    assert collective.completed is None  # NCCL: the kernel has not finished; gloo: the data has not arrived
    clock.now_ms = 14.0
    work.future.complete()  # NCCL runs it on a stream that waits for the kernel; gloo when the data is there
    if device_completion:
        assert isinstance(collective.completed, FakeEvent) and collective.completed.t_ms == 14.0
    else:
        assert collective.completed == pytest.approx(1000.014)  # host time: gloo with CUDA tensors keeps it
    clock.now_ms = 25.0
    work.future.complete()  # a late second callback does not move it
    handed.wait()  # waited for much later: from 25 ...
    clock.now_ms = 30.0
    handed.wait()  # ... a second wait, which would return at once, does not replace the first
    finished = recorder.finish_step()
    (c,) = finished.collectives
    # ... but busy ends at the real completion (14 ms), not at the end of the wait (30 ms)
    assert (c.launched, c.completed) == (pytest.approx(10.0), pytest.approx(14.0))
    assert c.wait == (pytest.approx(25.0), pytest.approx(25.0))


def test_a_finished_collective_whose_callback_has_not_run_gets_its_completion_at_the_step_end() -> None:
    # The data arrived during the step, but the callback waits for the GIL the training thread holds to the step's
    # end (seen under load: an all-reduce of DDP's with busy 0). The step's end (20 ms) lets it run: the completion
    # reads 20 ms, an upper bound as a wait's end is. One still in flight is left alone.
    clock = FakeCudaClock()
    recorder = Recorder(clock=clock)
    recorder.open_step(0)
    clock.now_ms = 10.0
    arrived, in_flight = FakeWork(), FakeWork()
    recorder.issued(recorder.launch("all_reduce", 4096, "world"), arrived, device_completion=False)
    recorder.issued(recorder.launch("all_reduce", 4096, "world"), in_flight, device_completion=False)
    arrived.future.completed = True  # done, its callback not run yet (a future is done before its callbacks run)
    clock.now_ms = 20.0
    first, second = recorder.finish_step().collectives
    assert (first.launched, first.completed) == (pytest.approx(10.0), pytest.approx(20.0))  # busy 10 ms, not 0
    assert second.completed == pytest.approx(second.launched)  # no completion: never waited for here
    assert in_flight.future.callbacks and not in_flight.future.done()


class TorchFutureWork:
    """A work whose future is torch's own, holding the collective's output as a real one does."""

    def __init__(self, output: torch.Tensor) -> None:
        self.future = torch.futures.Future()
        self.output = output

    def get_future(self) -> torch.futures.Future:
        return self.future

    def complete(self) -> None:
        self.future.set_result([self.output])  # runs the callbacks, as the backend's thread does


def test_the_recorder_lets_go_of_a_collective_once_its_completion_is_recorded() -> None:
    # Measuring never changes what is measured: a finished collective's future kept to the step's end kept its
    # tensors alive as long (FSDP2's gathered parameters: the memory benchmark's fsdp2 peak grew by 1.2 GiB per rank).
    recorder = Recorder(clock=FakeCudaClock())
    recorder.open_step(0)
    work = TorchFutureWork(torch.zeros(1024))
    gathered = weakref.ref(work.output)
    handed = recorder.issued(recorder.launch("all_gather", 4096, "world"), work, device_completion=False)
    work.complete()
    del work, handed  # the caller waited and let go of its work
    gc.collect()
    assert gathered() is None
    assert recorder.finish_step().collectives[0].completed is not None
    # one still in flight at the step's end is not held past it either: once it completes, nothing of ours holds it
    # (until then its pending callback does, as torch's own ``then`` keeps a future alive)
    recorder.open_step(1)
    work = TorchFutureWork(torch.zeros(1024))
    gathered = weakref.ref(work.output)
    recorder.issued(recorder.launch("all_gather", 4096, "world"), work, device_completion=False)
    recorder.finish_step()
    work.complete()
    del work
    gc.collect()
    assert gathered() is None


def test_a_collective_without_a_completion_falls_back_to_the_end_of_its_wait() -> None:
    clock = FakeCudaClock()
    recorder = Recorder(clock=clock)
    recorder.open_step(0)
    collective = Collective("all_reduce", "x", 4, FakeEvent(5.0), wait=(FakeEvent(6.0), FakeEvent(9.0)))
    recorder.record.collectives.append(collective)
    assert recorder.finish_step().collectives[0].completed == pytest.approx(9.0)


def _pretend_spec(monkeypatch, spec: str) -> None:
    """Make the process group look initialised with backend ``spec``, as torch describes such a group:
    ``get_backend`` returns the spec as given, ``get_backend_config`` torch's device map of it."""
    config = str(dist.distributed_c10d.BackendConfig(spec))  # e.g. "nccl" -> "cuda:nccl"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: spec)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)


class FutureLessWork(FakeWork):
    """gloo's reduce-scatter work: ``get_future`` raises, only a wait says when it is done."""

    def get_future(self) -> FakeFuture:
        raise RuntimeError("Work::getFuture not implemented.")


def test_a_work_without_a_future_completes_when_its_wait_returns() -> None:
    clock = FakeCudaClock()
    recorder = Recorder(clock=clock)
    recorder.open_step(0)
    clock.now_ms = 10.0
    collective = recorder.launch("reduce_scatter", 64, "world")
    handed = recorder.issued(collective, FutureLessWork(), device_completion=False)
    assert collective.completed is None
    clock.now_ms = 12.0

    def blocking_wait() -> bool:  # the collective takes until 17 ms to finish
        clock.now_ms = 17.0
        return True

    handed.work.wait = blocking_wait
    assert handed.wait() is True  # what FSDP2 or dist.reduce_scatter_tensor calls on the work they get back
    (c,) = recorder.finish_step().collectives  # no completion mark: the end of the wait stands in for it
    assert (c.launched, c.completed) == (pytest.approx(10.0), pytest.approx(17.0))


@pytest.mark.parametrize("backends, expected", [
    # the mixed spec: a CUDA tensor goes over NCCL, a CPU tensor over gloo
    ({"cuda": "nccl", "cpu": "gloo"}, {"cuda": FakeEvent, "cpu": float}),
    ({"cuda": "gloo", "cpu": "gloo"}, {"cuda": float, "cpu": float}),  # gloo with CUDA tensors (2 ranks on one GPU)
    ({"cuda": "nccl"}, {"cuda": FakeEvent}),  # NCCL moves CUDA tensors only
])
def test_the_recording_group_asks_for_device_completion_where_nccl_moves_the_tensor(
    world_of_one, monkeypatch, backends: dict, expected: dict
) -> None:
    from lightning_ddp import compat
    from lightning_ddp.sync.recording_group import RecordingProcessGroup

    group = RecordingProcessGroup(dist.group.WORLD, "world")
    monkeypatch.setattr(compat, "backend_name", lambda _group, device: backends[torch.device(device).type])
    group.recorder = recorder = Recorder(clock=FakeCudaClock())
    recorder.open_step(0)
    for device_type, completion in expected.items():
        launch = group._launch("all_reduce", 16, torch.device(device_type))
        work = FakeWork()
        group._issued(launch, work)
        work.future.complete()
        assert isinstance(launch.collective.completed, completion), (backends, device_type)
    group.recorder = None  # unarmed: nothing is launched, the check is all it costs
    assert group._launch("all_reduce", 16, torch.device("cpu")) is None


@pytest.mark.parametrize("spec, device, expected", [
    ("nccl", "cuda", "nccl"),  # a plain name applies to every device ...
    ("nccl", "cpu", "nccl"),  # ... even one it cannot serve: the strategy turns that into an error with the fix
    ("gloo", "cuda:1", "gloo"),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo"),  # device-qualified: the entry for the device's type
    ("cpu:gloo,cuda:nccl", torch.device("cuda", 1), "nccl"),
    ("CUDA:NCCL, cpu:gloo", "cuda:0", "nccl"),  # torch lower-cases the spec; spaces after commas are tolerated
    ("cpu:gloo", "cuda", None),  # nothing serves CUDA tensors in this group
])
def test_backend_from_spec_reads_plain_and_device_qualified_specs(spec: str, device, expected) -> None:
    from lightning_ddp.sync.comm import backend_from_spec

    assert backend_from_spec(spec, device) == expected


def test_parse_backend_spec_and_its_errors() -> None:
    from lightning_ddp.sync.comm import parse_backend_spec

    assert parse_backend_spec("gloo") == {"*": "gloo"}  # "*": every device
    assert parse_backend_spec("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="cpu:gloo,cuda:nccl"):  # the message shows the expected form
        parse_backend_spec("cpu:gloo,cuda")
    with pytest.raises(ValueError, match="twice"):
        parse_backend_spec("cuda:nccl,cuda:gloo")


def test_backend_for_reads_the_live_group(monkeypatch) -> None:
    from lightning_ddp.sync.comm import backend_for

    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)  # torch takes it on CPU
    try:
        assert dist.get_backend() == "cpu:gloo"  # the spec as given: comparing it with "gloo" fails
        assert backend_for("cpu") == backend_for(torch.device("cpu")) == "gloo"
        with pytest.raises(ValueError, match="no backend for cuda tensors.*cuda:nccl"):
            backend_for("cuda:0")
        _pretend_spec(monkeypatch, "cpu:gloo,cuda:nccl")
        assert (backend_for("cpu"), backend_for("cuda:1")) == ("gloo", "nccl")
    finally:
        dist.destroy_process_group()


def test_zero1_auto_collectives_follow_the_parameters_device(monkeypatch) -> None:
    from lightning_ddp.sync.sharding import ShardedOptimizer, resolve_collectives

    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        optimizer = ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
        assert optimizer.collectives == "per_owner"  # gloo moves the CPU parameters ("cpu:gloo" != "gloo")
        _pretend_spec(monkeypatch, "cpu:gloo,cuda:nccl")
        assert resolve_collectives("auto", "cpu") == "per_owner"  # gloo: reduce / broadcast per owner
        assert resolve_collectives("auto", "cuda:0") == "native"  # NCCL: reduce-scatter / all-gather
        assert resolve_collectives("per_owner", "cuda:0") == "per_owner"  # a choice made is kept
    finally:
        dist.destroy_process_group()


def test_bucket_measurement_defaults_to_the_device_nccl_serves(world_of_one, monkeypatch) -> None:
    from lightning_ddp.sync.bucket_model import default_measure_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert default_measure_device() == torch.device("cpu")  # a plain gloo group
    _pretend_spec(monkeypatch, "cpu:gloo,cuda:nccl")  # the gradients of such a run are on the GPU, over NCCL
    assert default_measure_device() == torch.device("cuda", 1)


@pytest.mark.parametrize("spec, device, error", [
    ("nccl", "cpu", "needs CUDA GPUs"),
    ("cpu:nccl", "cpu", "needs CUDA GPUs"),
    ("cuda:nccl", "cpu", "no backend for cpu"),  # nothing would move this run's CPU tensors
    ("cpu:gloo,cuda:nccl", "cpu", None),  # gloo serves the CPU run: no error ...
    ("gloo", "cpu", None),
])
def test_the_strategy_checks_the_backend_of_its_own_device(spec: str, device: str, error: str | None) -> None:
    from lightning_ddp.strategies import GradSyncStrategy

    strategy = GradSyncStrategy(parallel_devices=[torch.device(device)], process_group_backend=spec)
    if error is None:
        strategy.check_process_group_backend()
    else:
        with pytest.raises(ValueError, match=error):
            strategy.check_process_group_backend()


def test_one_synchronize_per_measured_step_and_the_next_anchor_for_free() -> None:
    clock = FakeCudaClock()
    recorder = Recorder(clock=clock)
    recorder.open_step(0)  # the first step has no anchor yet: one synchronize to take it
    assert clock.synchronizes == 1
    for step in range(1, 4):
        clock.now_ms += 50.0
        recorder.finish_step()  # the step's synchronize ...
        recorder.open_step(step)  # ... anchors the next step: no second drain
        assert clock.synchronizes == 1 + step
    finished = recorder.finish_step()
    assert clock.synchronizes == 5  # 4 steps, 1 initial anchor + 1 per finished step
    assert finished.step_ms == pytest.approx(0.0)


# ---- the StepClock on a GPU: the anchor's midpoint, every event on the device's current stream -----------------


class FakeStream:
    """``torch.cuda.current_stream(device)``: which device's current stream it is."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


class RecordingEvent:
    """A ``torch.cuda.Event`` that remembers the stream it was recorded on."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.stream: object = "never recorded"

    def record(self, stream=None) -> None:
        self.stream = stream  # None: torch would take the *current device's* current stream


@pytest.fixture
def fake_cuda(monkeypatch):
    """Events that remember their stream, a per-device current stream, a synchronize that does nothing."""
    monkeypatch.setattr(torch.cuda, "Event", RecordingEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(torch.device(device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_the_anchor_takes_t0_midway_between_two_host_reads_around_e0(fake_cuda, monkeypatch) -> None:
    from lightning_ddp.sync import record as record_module

    clock = StepClock("cuda:1")
    reads = [100.0, 100.004]  # before and after e0.record(): the record call took 4 ms (an extreme case)

    def perf_counter() -> float:
        return reads.pop(0)

    with monkeypatch.context() as patch:  # only around the anchor: pytest reads the clock too
        patch.setattr(record_module.time, "perf_counter", perf_counter)
        clock.anchor()
    # e0 fired somewhere between the two reads: the midpoint is off by at most half the call (2 ms), a read before
    # or after the call by up to all of it (4 ms)
    assert clock.t0 == pytest.approx(100.002) and reads == []
    assert clock.e0.stream.device == torch.device("cuda", 1)  # recorded on the engine's device's current stream


def test_every_mark_is_recorded_on_the_current_stream_of_the_engines_device(fake_cuda) -> None:
    clock = StepClock(torch.device("cuda", 1))
    # Marks are taken on other threads too (NCCL's future callbacks, autograd's gradient hooks), whose current
    # device may be another GPU; event.record() with no stream would then mark that GPU's stream.
    event = clock.mark()
    assert isinstance(event.stream, FakeStream) and event.stream.device == torch.device("cuda", 1)


# ---- the engines: pre-scaling, presence flags last, pack spans ---------------------------------------------


class _Small(nn.Module):
    def __init__(self, unused: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        if unused:
            self.unused = nn.Linear(3, 3)  # never called: its .grad must stay None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("algorithm", catalogue.names(engines_only=True))
def test_gradients_are_divided_before_they_are_sent(world_of_one, monkeypatch, algorithm: str) -> None:
    # Pretend to be 2 ranks whose other rank holds the same gradients: the fake all-reduce records what it was
    # given and doubles it in place (the SUM over 2 equal contributions). Pre-scaled, every tensor sent holds
    # g / 2 and the result is g; divided after the wait it would send g, and get 2g divided to g only later.
    sent: list[torch.Tensor] = []

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        sent.append(tensor.detach().clone())
        tensor.mul_(2)
        return FakeWork()

    torch.manual_seed(0)
    model = _Small()
    reference = copy.deepcopy(model)
    engine = catalogue.get(algorithm).make_engine(model)
    engine.world_size = engine.comm.world_size = 2
    monkeypatch.setattr(comm_module.dist, "all_reduce", fake_all_reduce)
    x = torch.randn(4, 5)
    engine.on_train_batch_start()
    engine(x).sum().backward()
    engine.finish_gradient_synchronization()
    reference(x).sum().backward()
    local = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    if isinstance(getattr(engine, "reduce", None), BF16CompressedAllReduce):  # what went over the wire: bf16-rounded
        local = {n: g.to(torch.bfloat16).float() for n, g in local.items()}
    # (PowerSGD averages its first steps exactly: at its default start_iter, this one step is such a step.)
    for name, param in model.named_parameters():
        if name.startswith("unused"):
            assert param.grad is None, name  # no rank had one: presence flags (also pretend-summed) say so
        else:
            # halving and doubling are exact in binary floating point (and commute with rounding to bf16)
            torch.testing.assert_close(param.grad, local[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    if hasattr(engine, "bucket_indices"):  # the last bucket's sentinel, 1 (this rank misses the unused layer) pre-scaled
        assert sent[-2][-1].item() == 0.5 and sent[-1].dtype == torch.int32  # ... so the presence flags follow it
        sent[-2] = sent[-2][:-1]
    sent_gradients = torch.cat([t.reshape(-1).float() for t in sent if t.dtype != torch.int32])
    expected_halves = torch.cat([g.reshape(-1) / 2 for g in local.values()])
    # every non-zero value sent is half of a local gradient value (zeros stand in for the unused layer)
    assert set(sent_gradients[sent_gradients != 0].tolist()) <= set(expected_halves.tolist())


def _recorded_step(engine: nn.Module) -> SyncRecord:
    """One recorded training step of ``engine`` on a random (4, 5) batch."""
    engine.recorder = recorder = Recorder()
    recorder.open_step(0)
    engine.on_train_batch_start()
    engine(torch.randn(4, 5)).sum().backward()
    engine.finish_gradient_synchronization()
    return recorder.finish_step()


def test_bucketed_reads_the_presence_flags_after_every_bucket(world_of_one) -> None:
    model = _Small()
    engine = catalogue.get("bucketed_ddp").make_engine(model, bucket_size_mb=100 / 2**20)  # several buckets
    record = _recorded_step(engine)
    *buckets, flags = record.collectives
    assert flags.label == "gradient presence flags" and len(buckets) == len(engine.bucket_indices) > 2
    # issued after every bucket, waited for after every bucket's wait ended: it never holds up an unpack
    assert all(flags.launched >= c.launched and flags.wait[0] >= c.wait[1] for c in buckets)
    assert model.unused.weight.grad is None  # unpacked (as zeros) first, then reset from the flags


@pytest.mark.parametrize("algorithm", catalogue.names(engines_only=True))
def test_every_copy_and_scaling_of_gradients_is_a_pack_span(world_of_one, algorithm: str) -> None:
    # No unused layer here: it would sit in the first bucket of the reverse walk and, never ready, hold every
    # bucket back until the synchronisation (buckets launch strictly in order).
    model = _Small(unused=False)
    engine = catalogue.get(algorithm).make_engine(model, bucket_size_mb=100 / 2**20
                                                  if catalogue.get(algorithm).has_bucket_size else "default")
    record = _recorded_step(engine)
    ((sync_start, sync_end),) = record.exposed
    inside = [span for span in record.pack if sync_start <= span[0] and span[1] <= sync_end]
    before = [span for span in record.pack if span[1] <= sync_start]
    assert record.pack, algorithm
    if catalogue.get(algorithm).overlaps_backward:
        assert before, "the pre-scaling of buckets launched from the hooks is a pack span during backward"
    else:
        assert inside and not before, "naive and flat copy and scale inside the synchronisation"


# ---- ZeRO-1 and fp16, RoPE under bf16-true ---------------------------------------------------------------------


def test_sharded_strategies_refuse_fp16_where_gradients_differ_across_ranks_and_name_the_fix() -> None:
    from lightning_ddp.strategies import ZeRO1DDPStrategy, ZeRO2DDPStrategy

    with pytest.raises(ValueError, match="bf16-mixed.*allreduce_broadcast"):
        ZeRO1DDPStrategy(schedule="reduce_scatter").check_supported("16-mixed")
    with pytest.raises(ValueError, match="bf16-mixed.*zero1_ddp"):
        ZeRO2DDPStrategy().check_supported("16-mixed")
    # Gradients averaged in backward: every rank sees the same inf.
    ZeRO1DDPStrategy(schedule="allreduce_broadcast").check_supported("16-mixed")
    ZeRO1DDPStrategy(schedule="reduce_scatter").check_supported("bf16-mixed")
    ZeRO2DDPStrategy().check_supported("bf16-mixed")


def test_a_bf16_cast_keeps_the_rope_angles_in_fp32() -> None:
    from lightning_ddp.model import GPT, get_config

    model = GPT(get_config("tiny", context_length=256))
    exact = model.rope_cos.clone(), model.rope_sin.clone()
    model.to(torch.bfloat16)  # what bf16-true does to the whole module
    assert model.tok_emb.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert torch.equal(model.rope_cos, exact[0]) and torch.equal(model.rope_sin, exact[1])
    # the rounding it avoids: bf16 keeps 8 mantissa bits, ~0.4 % of a cos/sin value near 1
    rounded = exact[1].to(torch.bfloat16).float()
    assert (rounded - exact[1]).abs().max() > 1e-3


# ---- GPU traces: compute from kernels ---------------------------------------------------------------------------


def test_on_cuda_traces_the_compute_is_the_non_communication_kernels(tmp_path: Path) -> None:
    from lightning_ddp.sync import ranges
    from lightning_ddp.trace import RunTraces, load_rank_trace, render_timeline

    pid, tid = 100, 7
    host = lambda name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    kernel = lambda name, ts, dur: {"ph": "X", "pid": 0, "tid": 20, "cat": "kernel", "name": name, "ts": ts,  # noqa: E731
                                    "dur": dur}
    events = [
        host(ranges.step_range_name(3), 0, 1000),
        host(ranges.BACKWARD, 0, 200),  # the host queued the whole backward in 200 us ...
        kernel("sm90_gemm_bf16", 100, 300), kernel("elementwise_kernel", 400, 300),  # ... the GPU ran it 100-700
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 500, 400),  # communication, not compute
        {"ph": "X", "pid": 0, "tid": 21, "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 800, "dur": 50},
        {"ph": "X", "pid": pid, "tid": 2**30, "cat": ranges.COMM_CATEGORY, "name": "all_reduce", "ts": 500,
         "dur": 400, "args": {"label": "bucket 0"}},
    ]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events, ranges.METADATA_KEY: {"rank": 0, "pid": pid, "tid": tid}}))
    trace = load_rank_trace(path)
    assert trace.gpu_compute == [(100.0, 700.0)]  # the two kernels, merged; NCCL and memcpy left out
    assert trace.compute() == [(100.0, 700.0)]
    # comm [500, 900] overlaps GPU compute [100, 700] for 200 of 400 us. With the host ranges (0-200) it would
    # have been 0 %: the host had long finished queueing when the kernels ran.
    assert trace.overlap("record").fraction == pytest.approx(0.5)
    timeline = render_timeline([RunTraces("gpu", [trace])], tmp_path / "t.png")
    assert [(row.kind, row.bars) for row in timeline.rows] == [("compute", 1), ("gpu", 1), ("comm", 1)]


def test_chained_fakes_are_consistent() -> None:
    # The fake clock converts host times and events onto one axis, as StepClock does on a GPU.
    clock = FakeCudaClock()
    clock.now_ms = 3.0
    clock.anchor()
    clock.now_ms = 7.5
    assert clock.to_ms(clock.mark()) == pytest.approx(4.5)
    assert clock.to_ms(clock.host_time()) == pytest.approx(4.5)
    assert clock.synchronizes == 1


def test_gradients_are_views_into_the_buckets_and_accumulate_there(world_of_one) -> None:
    model = _Small(unused=False)
    engine = catalogue.get("bucketed_ddp").make_engine(model, bucket_size_mb=None)  # one bucket holding everything
    (bucket,) = engine._buckets
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        engine.on_train_batch_start()
        engine(torch.randn(4, 5)).sum().backward()
        if step > 0:  # zeroed in place last step: backward accumulated straight into the bucket
            assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(bucket.params, bucket.views))
        engine.finish_gradient_synchronization()
        # after the sync every .grad is its slice of the bucket: nothing was copied back
        assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(bucket.params, bucket.views))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


# ---- a measurement never ends a run: inconsistent marks are clamped and counted ------------------------------


def _c(launched: float, completed: float, nbytes: int = 0) -> Collective:
    return Collective("all_reduce", "test", nbytes, launched, completed)


def _clean_summary() -> TimingSummary:
    summary = TimingSummary()
    summary.add(0, step_metrics(StepTiming(step_ms=5.0, exposed=[(1.0, 2.0)]), world_size=2))
    return summary


def _backwards_timing() -> StepTiming:
    # A 10 ms step whose marks came from two clocks: the second exposed span ends 2 ms before it starts, the pack
    # span 0.5 ms before, the second collective completes 0.1 ms before its launch.
    return StepTiming(
        step_ms=10.0,
        exposed=[(2.0, 4.0), (5.0, 3.0)],
        pack=[(1.0, 0.5)],
        collectives=[Collective("all_reduce", "bucket 0", 100, 1.0, 2.0),
                     Collective("all_reduce", "bucket 1", 100, 8.0, 7.9)],
        tokens=10,
    )


def test_a_backwards_interval_is_clamped_to_zero_length_and_counted() -> None:
    timing = _backwards_timing()  # used to raise "ends before it starts": the run died at step 0
    assert timing.exposed == [(2.0, 4.0), (5.0, 5.0)] and timing.pack == [(1.0, 1.0)]  # end = start
    assert (timing.collectives[1].launched, timing.collectives[1].completed) == (8.0, 8.0)
    m = step_metrics(timing, world_size=2)
    assert m["comm/clock_anomalies"] == 3.0  # three clamped intervals
    assert m["comm/exposed_ms"] == pytest.approx(2.0)  # [2, 4]; the clamped span adds nothing
    assert m["comm/pack_ms"] == 0.0
    assert m["comm/busy_ms"] == pytest.approx(1.0)  # [1, 2]; the clamped collective adds nothing
    assert m["comm/calls"] == 2.0 and m["comm/bytes"] == 200.0  # it was still launched: it still counts
    assert all(math.isfinite(value) for value in m.values())


def test_the_exposed_span_from_last_gradient_to_usable_is_clamped_not_dropped() -> None:
    record = SyncRecord(started=0.0, ended=10.0, last_ready=6.0, usable=5.5)  # usable 0.5 ms before the last grad
    timing = StepTiming.from_record(record, step_ms=10.0, tokens=1)
    assert timing.exposed == [(6.0, 6.0)]
    assert step_metrics(timing, world_size=1)["comm/clock_anomalies"] == 1.0  # it used to vanish silently


@pytest.mark.parametrize("step_ms", [0.0, -3.0, math.nan, math.inf])
def test_a_step_time_that_is_not_positive_and_finite_gives_finite_metrics(step_ms: float) -> None:
    timing = StepTiming(step_ms=step_ms, exposed=[(0.0, 1.0)], collectives=[_c(0.0, 1.0)], tokens=8)
    m = step_metrics(timing, world_size=2, flops_per_step=8.0, peak_flops=1.0)
    assert m["comm/clock_anomalies"] == 1.0
    # no step to divide by: the step time is 0 and every share of it 0 (as overlap is 0 when nothing was busy)
    assert (m["step/time_ms"], m["comm/share"], m["step/tokens_per_s"], m["step/mfu"]) == (0.0, 0.0, 0.0, 0.0)
    assert m["comm/exposed_ms"] == 1.0 and all(math.isfinite(value) for value in m.values())


def test_communication_longer_than_the_step_is_clamped_to_the_step() -> None:
    # exposed 12 ms and busy 15 ms in a 10 ms step: impossible on one clock (the step is the max over ranks)
    timing = StepTiming(step_ms=10.0, exposed=[(0.0, 12.0)], collectives=[_c(0.0, 15.0, 1_000_000)], tokens=1)
    m = step_metrics(timing, world_size=2)
    assert m["comm/clock_anomalies"] == 2.0  # exposed > step, busy > step
    assert m["comm/exposed_ms"] == 10.0 and m["comm/share"] == 1.0
    assert m["comm/busy_ms"] == 10.0 and 0.0 <= m["comm/overlap"] <= 1.0
    assert m["comm/algbw_GBps"] == pytest.approx(1e6 / 0.010 / 1e9)  # over the clamped 10 ms


def test_the_summary_counts_anomalies_and_warns_once_per_run(tmp_path: Path) -> None:
    summary = TimingSummary()
    with pytest.warns(ClockAnomalyWarning) as caught:
        for step in range(3):
            timing = _backwards_timing()
            summary.add(step, step_metrics(timing, world_size=2), anomalies=timing.anomalies)
    assert len(caught) == 1  # once per run, not once per step
    message = str(caught[0].message)
    assert "exposed interval (5.0, 3.0) ends 2 ms before it starts" in message  # which interval, by how much
    assert "two clocks" in message  # the likely cause
    assert summary.clock_anomalies == 9  # 3 per step
    summary.write_json(tmp_path / "timing_summary.json", warmup_steps=1)
    document = json.loads((tmp_path / "timing_summary.json").read_text())
    assert document["clock_anomalies"] == 9  # every step, warm-up included
    assert document["summary"]["comm/clock_anomalies"]["median"] == 3.0
    assert "clock anomalies: 9" in summary.format_table(warmup_steps=1)
    assert "clock anomalies" not in _clean_summary().format_table(warmup_steps=0)  # shown only when there are some


def test_every_metric_key_of_the_summary_includes_the_anomaly_count() -> None:
    assert "comm/clock_anomalies" in METRIC_KEYS
    assert '"comm/clock_anomalies": ' in inspect.getsource(step_metrics)  # computed by name where it is defined
    assert step_metrics(StepTiming(step_ms=5.0), world_size=1)["comm/clock_anomalies"] == 0.0


def test_a_gradient_ready_before_backward_started_does_not_stop_the_profile() -> None:
    from types import SimpleNamespace

    from lightning_ddp.callbacks.comm_timer import _median_profile

    # Two steps whose first gradient was marked 0.2 ms before backward's start (two clocks): median -0.2 ms.
    steps = [{"forward_ms": 5.0, "backward_ms": 9.0, "optimizer_ms": 1.0, "ready_ms": [-0.2, 4.0]}] * 2
    weight, bias = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(3))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), strategy_name="bucketed_ddp"),
                              precision="32-true", world_size=2)
    profile = _median_profile(steps, [("w", weight), ("b", bias)], trainer, SimpleNamespace(hparams={}), (2, 8))
    assert [p.ready_ms for p in profile.params] == [0.0, 4.0]  # clamped to backward's start, not a ValueError


def test_route_clipping_hands_sharded_optimizers_to_their_own_clipping_and_leaves_others_alone(world_of_one) -> None:
    import torch
    from lightning.pytorch.plugins.precision import Precision

    from lightning_ddp.strategies.sharded import route_clipping
    from lightning_ddp.sync import ShardedOptimizer

    plugin = Precision()
    route_clipping(plugin)
    route_clipping(plugin)  # idempotent: a second strategy set-up must not wrap the wrapper
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])  # norm 5
    sharded = ShardedOptimizer([weight], torch.optim.SGD, lr=1.0)
    plugin.clip_gradients(sharded, 1.0, "norm")
    # Not clipped yet: the sharded optimizer clips in step(), once the gradients are averaged on their owners.
    assert weight.grad.tolist() == [3.0, 4.0]
    sharded.step()
    assert sharded.last_grad_norm.item() == 5.0
    # clip_grad_norm_'s coefficient 1 / (5 + 1e-6) times [3, 4]: a division and a product, each rounded once in fp32
    clipped = torch.tensor([3.0, 4.0]) * (1.0 / (5.0 + 1e-6))
    torch.testing.assert_close(weight.grad, clipped, rtol=4 * 2.0**-24, atol=0.0)
    plugin.clip_gradients(sharded, 0.5, "value")
    sharded.step()
    assert weight.grad.tolist() == [0.5, 0.5] and sharded.last_grad_norm is None
    # A plain optimizer is clipped by Lightning's own code, at once.
    other = torch.nn.Parameter(torch.zeros(2))
    other.grad = torch.tensor([3.0, 4.0])
    plugin.clip_gradients(torch.optim.SGD([other], lr=1.0), 1.0, "norm")
    torch.testing.assert_close(other.grad, clipped, rtol=4 * 2.0**-24, atol=0.0)
