"""What a step communicated, recorded only while an observer has a ``Recorder`` armed (else one check per
collective): the recording process groups (``recording_group``) add every collective, whoever issues it; our engines
add the spans of their critical path. ``finish_step`` returns a ``SyncRecord`` in ms since ``open_step``'s anchor. The
clock rules: ``docs/algorithms.md``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Union

import torch
import torch.distributed as dist

Mark = Union[float, "torch.cuda.Event"]
Span = tuple[Mark, Mark]


class StepClock:
    """Marks on one axis: host seconds on CPU, CUDA events on GPU, both read relative to an anchor."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.t0 = time.perf_counter()
        self.e0: torch.cuda.Event | None = None

    def synchronize(self) -> None:
        """Wait until the device has run everything queued (CUDA); nothing to wait for on CPU."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def anchor(self, synchronize: bool = True) -> None:
        """Name one instant on both clocks (on CUDA: an event ``e0`` and host time ``t0``)."""
        if not self.cuda:
            self.t0 = time.perf_counter()
            return
        if synchronize:
            self.synchronize()
        stream = torch.cuda.current_stream(self.device)
        self.e0 = torch.cuda.Event(enable_timing=True)
        before = time.perf_counter()
        self.e0.record(stream)
        after = time.perf_counter()
        # e0 fires on the idle device somewhere between the two reads: the midpoint is off by at most half the call
        self.t0 = (before + after) / 2

    @staticmethod
    def host_time() -> float:
        """Now on the host clock (``time.perf_counter()`` seconds), whatever the device."""
        return time.perf_counter()

    def mark(self) -> Mark:
        """Now, as the device sees it (a CUDA event on this clock's device's current stream; host time on CPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def to_ms(self, mark: Mark) -> float:
        """Milliseconds from the anchor to ``mark``. On CUDA, call only after the events have completed."""
        if isinstance(mark, float):
            return (mark - self.t0) * 1e3
        assert self.e0 is not None, "StepClock.anchor() was not called before CUDA events were recorded"
        return self.e0.elapsed_time(mark)


@dataclass
class Collective:
    """One collective: what it moved and when it was launched, completed and waited for (ms in a finished record)."""

    op: str  # all_reduce, reduce_scatter, all_gather, reduce, broadcast, all_to_all or barrier
    label: str  # what was communicated: a parameter name, "bucket 3 (12 tensors)"; else the op
    nbytes: int
    """nccl-tests' message size: the buffer; the whole input of ``reduce_scatter``, output of ``all_gather``."""
    launched: Mark  # on CUDA: when the issuing stream reached the launch
    completed: Mark | None = None
    wait: Span | None = None  # the first wait for it (whoever waited), if anyone waited
    group: str = "world"  # the process group it ran on (``recording_group.group_label``): world, dp_shard, ...

    def converted(self, convert: Callable[[Mark], float]) -> Collective:
        """This collective with every mark converted; a missing completion becomes the wait's end, else the launch."""
        launched = convert(self.launched)
        wait = (convert(self.wait[0]), convert(self.wait[1])) if self.wait is not None else None
        if self.completed is not None:
            completed = convert(self.completed)
        else:
            completed = wait[1] if wait is not None else launched
        return dataclasses.replace(self, launched=launched, completed=completed, wait=wait)


@dataclass
class SyncRecord:
    """Everything one optimizer step communicated, and where the critical path spent time on it."""

    collectives: list[Collective] = field(default_factory=list)  # in launch order
    exposed: list[Span] = field(default_factory=list)
    """Intervals on the critical path spent synchronising (the engine's sync, the sharded optimizer's phases)."""
    pack: list[Span] = field(default_factory=list)
    """Intervals spent copying gradients into and out of communication buffers (flat, bucketed, ZeRO-1)."""
    started: Mark | None = None
    ended: Mark | None = None
    backward_started: Mark | None = None  # the last micro-batch's
    ready: list[Mark | None] = field(default_factory=list)
    """Per watched parameter, when its gradient was last computed in the step (``Recorder.watch_gradients``)."""
    last_ready: Mark | None = None  # the end of backward's gradient work
    usable: Mark | None = None  # when the gradients were ready for the optimizer
    origin_s: float | None = None  # in a finished record: the host time (time.perf_counter() s) of its 0 ms

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    @property
    def step_ms(self) -> float:
        """``ended - started`` of a finished record."""
        assert isinstance(self.started, float) and isinstance(self.ended, float), "only a finished record has ms"
        return self.ended - self.started

    def converted(self, convert: Callable[[Mark], float], origin_s: float | None = None) -> SyncRecord:
        """A copy with every mark converted by ``convert`` (e.g. to ms) and ``origin_s`` set."""
        def maybe(mark: Mark | None) -> float | None:
            return convert(mark) if mark is not None else None

        marks = {name: maybe(getattr(self, name)) for name in ("started", "ended", "backward_started", "last_ready",
                                                                "usable")}
        return SyncRecord(
            collectives=[c.converted(convert) for c in self.collectives],
            exposed=[(convert(a), convert(b)) for a, b in self.exposed],
            pack=[(convert(a), convert(b)) for a, b in self.pack],
            ready=[maybe(mark) for mark in self.ready],
            origin_s=origin_s,
            **marks,
        )

    def in_host_seconds(self) -> SyncRecord:
        """A finished record on the host clock: every mark as ``time.perf_counter()`` seconds."""
        assert self.origin_s is not None, "only a finished record (Recorder.finish_step) has an origin"
        origin = self.origin_s
        return self.converted(lambda ms: origin + ms / 1e3, origin)


@dataclass
class _Unfinished:
    """A collective of the open step whose completion callback has not run yet (the callback removes it)."""

    future: Any  # its work's future: holds the collective's tensors until the entry is dropped
    callback_done: Any = None  # the future of its completion callback (``future.then``)


class Recorder:
    """Collects one ``SyncRecord`` per optimizer step from whichever engines (and optimizers) it is attached to.

    A step is armed from ``open_step`` to ``finish_step``; between steps only with ``open_on_demand`` (the first
    collective then opens an unnumbered step). ``clock``: instead of ``StepClock(device)``.
    """

    def __init__(self, device: torch.device | str = "cpu", clock: StepClock | None = None,
                 open_on_demand: bool = True) -> None:
        self.clock = clock if clock is not None else StepClock(device)
        self.open_on_demand = open_on_demand
        self.armed = open_on_demand  # whether anything is recorded now: checked first on every path
        self.record = SyncRecord()  # the step being recorded (raw marks)
        self.step: int | None = None  # the number of the open (or last finished) step
        self.finished: SyncRecord | None = None  # the last finished step, in ms
        self.is_open = False  # a step is open (open_step until finish_step)
        self._anchored = False
        self._watched = 0
        self._hooks: list[Any] = []
        self._thread = threading.local()  # ``label``: the engine's name for the collective it is issuing
        self._unfinished: dict[int, _Unfinished] = {}
        """The open step's collectives whose completion callback has not run, by ``id``. Each leaves as its callback
        runs: a finished collective's future kept to the step's end would keep its tensors (FSDP2's gathered
        parameters) alive as long, and measuring would change the memory it measures."""

    def open_step(self, step: int | None = None) -> None:
        """Start recording optimizer step ``step`` (idempotent for the same open ``step``: several observers)."""
        if self.is_open and step is not None and step == self.step:
            return
        if not self._anchored:
            self.clock.anchor()
        self._anchored = False
        self.is_open = True
        self.armed = True
        self.step = step
        self.finished = None
        self._unfinished = {}
        self.record = SyncRecord(started=self.clock.mark(), ready=[None] * self._watched)

    def ensure_open(self) -> None:
        """Open an (unnumbered) step if none is open: a caller that never opens steps still gets records."""
        if not self.is_open:
            self.open_step()

    def finish_step(self) -> SyncRecord:
        """Mark the end and convert every mark to ms (after the step's one synchronize on CUDA); idempotent."""
        if not self.is_open:
            if self.finished is None:
                raise RuntimeError("Recorder.finish_step() without an open step: call open_step() first")
            return self.finished
        self.record.ended = self.clock.mark()
        self._await_completion_callbacks()
        clock = self.clock
        clock.synchronize()  # the step's one synchronize (CUDA): every event of the step can now be read
        self.finished = self.record.converted(clock.to_ms, clock.t0)
        if clock.cuda:
            clock.anchor(synchronize=False)  # the device is idle just now: the next step's anchor, for free
            self._anchored = True
        self.is_open = False
        self.armed = self.open_on_demand
        return self.finished

    def _await_completion_callbacks(self) -> None:
        """Let every finished collective's completion callback run before the step is converted. A future is done
        before its callbacks run, and ours runs on the backend's thread and needs the GIL, which the training thread
        may have held ever since (under load, to the step's end: the collective's busy time would read 0). Waiting
        for the callback's future lets go of the GIL; a collective still in flight is left alone, so that measuring
        never waits for one."""
        for pending in list(self._unfinished.values()):  # a callback that runs removes its own entry
            if pending.future.done():
                pending.callback_done.wait()
        self._unfinished = {}

    # -- the step's compute landmarks (the timer marks them) ---------------------------------------------

    def watch_gradients(self, params: list[torch.Tensor]) -> None:
        """Mark, in every open step, when each of ``params``'s gradients is computed (``ready``, ``last_ready``)."""
        self.unwatch_gradients()
        self._watched = len(params)
        self.record.ready = [None] * self._watched
        for index, param in enumerate(params):
            self._hooks.append(param.register_hook(self._ready_hook(index)))

    @property
    def watching(self) -> bool:
        """Whether gradient-ready hooks are registered (``watch_gradients`` until ``unwatch_gradients``)."""
        return bool(self._hooks)

    def unwatch_gradients(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._watched = 0

    def _ready_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.is_open:  # unarmed (a step nobody measures): nothing but this check
                mark = self.clock.mark()
                self.record.ready[index] = mark
                self.record.last_ready = mark

        return hook

    def mark_backward_started(self) -> None:
        """Backward begins (every micro-batch: the last one's mark stays)."""
        if self.is_open:
            self.record.backward_started = self.clock.mark()

    def mark_gradients_usable(self) -> None:
        """The gradients are ready for the optimizer (averaged, unless the optimizer averages them itself)."""
        if self.is_open:
            self.record.usable = self.clock.mark()

    # -- what the recording process groups call (``lightning_ddp.sync.recording_group``) -------------------

    def launch(self, op: str, nbytes: int, group: str) -> Collective:
        """The record of a collective about to be issued in the open step, launched now; labelled as the engine
        issuing it named it (``naming``), else by its op."""
        self.ensure_open()
        label, self._thread.label = getattr(self._thread, "label", None), None  # ``naming``'s, for one collective
        return Collective(op=op, label=label or op, nbytes=nbytes, launched=self.clock.mark(), group=group)

    def issued(self, collective: Collective, work: Any, device_completion: bool) -> RecordedWork:
        """Keep ``collective`` (``launch``'s, issued just now as ``work``) in the step, with when it completes (its
        future's callback: a CUDA event where ``device_completion``, NCCL's case, else the host clock) and when it is
        waited for. Returns what to hand the caller in ``work``'s place."""
        self.record.collectives.append(collective)
        clock, unfinished, key = self.clock, self._unfinished, id(collective)

        def on_done(_future: Any) -> None:
            if collective.completed is None:  # never overwrite a real completion
                # NCCL: an event on the callback's current stream, which waits for the collective's kernel.
                # gloo (CPU or CUDA tensors): the host clock, now that the data has arrived.
                collective.completed = clock.mark() if device_completion else clock.host_time()
            unfinished.pop(key, None)  # its future, and with it its tensors, are no longer ours to hold

        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce-scatter): done when waited for
            pass
        else:
            pending = _Unfinished(future)
            unfinished[key] = pending  # before ``then``: a callback that runs at once removes it
            pending.callback_done = future.then(on_done)
        return RecordedWork(work, collective, clock)

    # -- what our engines call (through ``Communicator``) -------------------------------------------------

    def mark(self) -> Mark:
        return self.clock.mark()

    @contextmanager
    def naming(self, label: str) -> Iterator[None]:
        """Inside, the next collective this thread issues is recorded as ``label`` (what our engines call theirs)."""
        self._thread.label = label
        try:
            yield
        finally:
            self._thread.label = None

    def span(self, kind: str, start: Mark) -> None:
        """Close a span of ``kind`` (``exposed`` or ``pack``) that began at ``start``."""
        getattr(self.record, kind).append((start, self.clock.mark()))


class RecordedWork(dist.Work):
    """The work of a recorded collective, handed to whoever issued it in its place: a wait on it is recorded (marks
    on the waiting thread's clock: host time, or events on the current CUDA stream, whose distance is the time the
    stream stalled for the collective). A work without a future completes, as far as anyone can tell, when a wait
    returns. Everything else is the work's own."""

    def __init__(self, work: Any, collective: Collective, clock: StepClock) -> None:
        super().__init__()
        self.work = work
        self.collective = collective
        self.clock = clock

    def wait(self, timeout: Any = None) -> bool:
        start = self.clock.mark()
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.collective.wait is None:  # the first wait is the one that blocked; later ones return at once
            self.collective.wait = (start, self.clock.mark())
        return done

    def get_future(self) -> Any:
        return self.work.get_future()  # raises as the work it stands for does

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def is_success(self) -> bool:
        return self.work.is_success()

    def exception(self) -> Any:
        return self.work.exception()

    def source_rank(self) -> int:
        return self.work.source_rank()

    def result(self) -> Any:
        return self.work.result()

    def synchronize(self) -> None:
        self.work.synchronize()
