"""What a step communicated, recorded only when someone measures: ``Recorder``, ``SyncRecord``, ``Collective``.

The engines never measure on their own. A ``Recorder`` is attached by whoever wants the numbers (the
``CommTimer``, the ``TraceRecorder``, a benchmark, a test; through the strategy's ``attach_recorder`` under
Lightning, or ``engine.recorder = Recorder(device)`` without it). With no recorder attached an engine pays one
``is None`` check per collective: no clock reads, no CUDA events, no synchronisation.

The life of one optimizer step's record::

    recorder.open_step(step)            # anchors the clocks, marks the start
    ... forward, backward, gradient sync, optimizer: the engines append collectives and spans ...
    record = recorder.finish_step()      # marks the end; on CUDA the step's one synchronize; every mark -> ms

``finish_step`` returns the record with every mark converted to **milliseconds since the step's clock anchor**
(plain floats), so everything downstream (``lightning_ddp.metrics.accounting``, the trace recorder) is pure
arithmetic.

Clocks (the honesty rules):

- On CPU a mark is ``time.perf_counter()``: collectives run on the host, so the host clock is the truth.
- On CUDA a mark is a ``torch.cuda.Event`` recorded on the current stream *of the engine's device*
  (``event.record(torch.cuda.current_stream(device))``): it says when the device reached that point, not when
  the host queued the work. The stream is named explicitly because marks are also taken on other threads (NCCL's
  future callbacks, autograd's gradient hooks) whose current device may be another GPU; ``event.record()`` alone
  would mark that GPU's stream. Events are only read in ``finish_step``, after its ``torch.cuda.synchronize()``.
- The anchor: host time ``t0`` and event ``e0`` naming the same instant, so that host times (gloo's completion
  callbacks) and events land on one axis. ``e0`` is recorded right after a synchronize, on an idle device, so it
  completes as soon as it is recorded; ``t0`` is the midpoint of two host reads taken just before and just after
  ``e0.record()``, so it is off by at most half that call (a single read on either side could be off by all of it).
  The synchronize at the end of one step anchors the next: one synchronize per measured step, none when nobody
  measures, and none in a step nobody opened (the ``CommTimer``'s unsampled steps: ``Recorder.armed``).
- When an async collective *completed* (``Collective.completed``), by the backend that moves its tensor (asked per
  device, ``lightning_ddp.sync.comm.backend_for``: a ``cpu:gloo,cuda:nccl`` group moves CUDA tensors with NCCL):
  gloo completes its ``Work`` future on its own thread when the data has arrived, so a ``then`` callback reads
  the host clock. NCCL completes the future when the work is queued, but runs ``then`` callbacks with a current
  stream that waits for the collective's kernel, so an event recorded there fires when the collective has
  finished on the device. No environment variable is needed for either. The mark after ``wait()`` is used only
  when no completion was recorded (it is an upper bound: the wait may start long after the collective finished),
  and never overwrites one.
- gloo with CUDA tensors (two ranks on one GPU) joins two clocks: launches are events, completions host times,
  through the one ``(e0, t0)`` pair. Gloo works on host copies of the tensors, and its future completes once the
  host result is there, *before* the copy back to the GPU (queued on a side stream) has finished. A completion
  can therefore precede the device copy-back: ``comm/busy_ms`` is slightly under-counted (by the copy-back), while
  ``comm/exposed_ms`` still covers the copy, because ``wait()`` makes the current stream wait for it and the
  exposed span ends with an event on that stream after the wait. Two clocks can also disagree outright; the
  accounting then clamps the marks and counts them (``comm/clock_anomalies``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

Mark = Union[float, "torch.cuda.Event"]
Span = tuple[Mark, Mark]

__all__ = ["Collective", "Mark", "Recorder", "StepClock", "SyncRecord"]


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
        """Name one instant on both clocks. On CUDA: synchronize (unless the caller just did), then record ``e0``
        on the idle device's current stream, with ``t0`` the midpoint of two host reads around the record call."""
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
        """Now, as the device sees it (on CUDA an event on the current stream of this clock's device, whatever the
        calling thread's current device; host time on CPU)."""
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
    """One collective: what it moved and when it was launched, completed and waited for.

    Marks are raw (host seconds or CUDA events) while the step runs and milliseconds since the step's anchor
    in a finished record (``Recorder.finish_step``).
    """

    op: str
    """Collective kind: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``reduce``, ``broadcast``."""
    label: str
    """What was communicated: a parameter name, ``bucket 3 (12 tensors)``, ``flat (435 tensors)``."""
    nbytes: int
    """nccl-tests' message size: the buffer being all-reduced, reduced or broadcast; for ``reduce_scatter`` the
    whole input and for ``all_gather`` the whole output (every rank's part)."""
    launched: Mark
    """When the collective was issued (on CUDA: when the issuing stream reached that point)."""
    completed: Mark | None = None
    """When its result was ready (see the module docstring for how, per backend)."""
    wait: Span | None = None
    """The interval the caller spent in ``Work.wait()`` for it, if anyone waited."""

    def converted(self, convert: Callable[[Mark], float]) -> Collective:
        """This collective with every mark converted (e.g. to ms). Without a recorded completion, completion is the
        end of the wait (the result was certainly there then), or, never waited for, the launch (nothing observed
        it in flight)."""
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

    collectives: list[Collective] = field(default_factory=list)
    """Every collective of the step, in launch order."""
    exposed: list[Span] = field(default_factory=list)
    """Intervals on the critical path spent synchronising (``finish_gradient_synchronization``; ZeRO-1's phases
    inside ``optimizer.step()``)."""
    pack: list[Span] = field(default_factory=list)
    """Intervals spent copying gradients into and out of communication buffers (flat, bucketed, ZeRO-1)."""
    started: Mark | None = None
    """The step's start (``Recorder.open_step``)."""
    ended: Mark | None = None
    """The step's end (``Recorder.finish_step``)."""
    backward_started: Mark | None = None
    """When the (last micro-batch's) backward began (``Recorder.mark_backward_started``)."""
    ready: list[Mark | None] = field(default_factory=list)
    """Per watched parameter, when its gradient was last computed in the step (``Recorder.watch_gradients``)."""
    last_ready: Mark | None = None
    """When the last gradient of the step was computed: the end of backward's gradient work."""
    usable: Mark | None = None
    """When the gradients were ready for the optimizer (``Recorder.mark_gradients_usable``)."""
    origin_s: float | None = None
    """In a finished record: the host time (``time.perf_counter()`` seconds) of its 0 ms."""

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

        return SyncRecord(
            collectives=[c.converted(convert) for c in self.collectives],
            exposed=[(convert(a), convert(b)) for a, b in self.exposed],
            pack=[(convert(a), convert(b)) for a, b in self.pack],
            started=maybe(self.started),
            ended=maybe(self.ended),
            backward_started=maybe(self.backward_started),
            ready=[maybe(mark) for mark in self.ready],
            last_ready=maybe(self.last_ready),
            usable=maybe(self.usable),
            origin_s=origin_s,
        )

    def in_host_seconds(self) -> SyncRecord:
        """A finished record on the host clock: every mark as ``time.perf_counter()`` seconds."""
        assert self.origin_s is not None, "only a finished record (Recorder.finish_step) has an origin"
        origin = self.origin_s
        return self.converted(lambda ms: origin + ms / 1e3, origin)


class Recorder:
    """Collects one ``SyncRecord`` per optimizer step from whichever engines (and optimizers) it is attached to.

    Armed or not: every recording path (``Communicator``'s collectives and spans, the gradient hooks, the compute
    landmarks) checks ``armed`` first and returns at once when it is false, so a step nobody measures costs one
    attribute read per collective and per gradient. A step is armed from ``open_step`` to ``finish_step``; between
    steps the recorder stays armed only with ``open_on_demand`` (the default: a caller that never opens steps, e.g.
    an engine measured on its own, still gets records, the first collective opening an unnumbered step). The
    observers under Lightning (``lightning_ddp.metrics.recording``) use ``open_on_demand=False`` and open only the
    steps they measure: the ``CommTimer``'s sampled steps (``every_n_steps``) and the ``TraceRecorder``'s traced ones.

    Args:
        device: Where the model computes: CUDA events on a GPU, host time otherwise.
        clock: The clock to use instead of ``StepClock(device)`` (tests give a fake one).
        open_on_demand: Whether a collective recorded while no step is open opens one (see above).
    """

    def __init__(self, device: torch.device | str = "cpu", clock: StepClock | None = None,
                 open_on_demand: bool = True) -> None:
        self.clock = clock if clock is not None else StepClock(device)
        self.open_on_demand = open_on_demand
        self.armed = open_on_demand
        """Whether anything is recorded now: a step is open, or ``open_on_demand``. Checked first on every path."""
        self.record = SyncRecord()
        """The step being recorded (raw marks); appended to by the engines."""
        self.step: int | None = None
        """The number of the open (or last finished) step, as given to ``open_step``."""
        self.finished: SyncRecord | None = None
        """The last finished step, in milliseconds (``finish_step``'s return value)."""
        self._open = False
        self._anchored = False
        self._watched = 0
        self._hooks: list[Any] = []

    @property
    def is_open(self) -> bool:
        return self._open

    def open_step(self, step: int | None = None) -> None:
        """Start recording optimizer step ``step``: a fresh record, marked started now.

        Idempotent for the same ``step`` number while it is open, so several observers (the timer, the trace
        recorder) may each open the step they see. On CUDA the first step synchronizes once to anchor the clocks;
        later steps reuse the anchor their predecessor's ``finish_step`` took.
        """
        if self._open and step is not None and step == self.step:
            return
        if not self._anchored:
            self.clock.anchor()
        self._anchored = False
        self._open = True
        self.armed = True
        self.step = step
        self.finished = None
        self.record = SyncRecord(started=self.clock.mark(), ready=[None] * self._watched)

    def ensure_open(self) -> None:
        """Open an (unnumbered) step if none is open: a caller that never opens steps still gets records."""
        if not self._open:
            self.open_step()

    def finish_step(self) -> SyncRecord:
        """Mark the end, convert every mark to ms (after the step's one ``torch.cuda.synchronize()`` on CUDA).

        Idempotent: a second call for the same step returns the same finished record.
        """
        if not self._open:
            if self.finished is None:
                raise RuntimeError("Recorder.finish_step() without an open step: call open_step() first")
            return self.finished
        self.record.ended = self.clock.mark()
        clock = self.clock
        clock.synchronize()  # the step's one synchronize (CUDA): every event of the step can now be read
        self.finished = self.record.converted(clock.to_ms, clock.t0)
        if clock.cuda:
            clock.anchor(synchronize=False)  # the device is idle just now: the next step's anchor, for free
            self._anchored = True
        self._open = False
        self.armed = self.open_on_demand
        return self.finished

    # -- the step's compute landmarks (the timer marks them) ---------------------------------------------

    def watch_gradients(self, params: list[torch.Tensor]) -> None:
        """Mark, every step, when each of ``params``'s gradients is computed (``ready``, ``last_ready``).

        A tensor hook (``Tensor.register_hook``) on each parameter: it fires when autograd has computed that
        gradient, before it is accumulated into ``.grad`` and before any engine's post-accumulate hook launches
        communication for it, so the mark is the end of the compute. Only while a step is open. One mark per
        gradient per backward: the cost of measuring, paid only when someone measures (``unwatch_gradients``).
        """
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
            if self._open:  # unarmed (a step nobody measures): nothing but this check
                mark = self.clock.mark()
                self.record.ready[index] = mark
                self.record.last_ready = mark

        return hook

    def mark_backward_started(self) -> None:
        """Backward begins (every micro-batch: the last one's mark stays)."""
        if self._open:
            self.record.backward_started = self.clock.mark()

    def mark_gradients_usable(self) -> None:
        """The gradients are ready for the optimizer (averaged, unless the optimizer averages them itself)."""
        if self._open:
            self.record.usable = self.clock.mark()

    # -- what the engines call (through ``Communicator``) ------------------------------------------------

    def mark(self) -> Mark:
        return self.clock.mark()

    def add(self, collective: Collective, work: Any, device_completion: bool) -> None:
        """Append ``collective`` (launched just now) and record its completion when ``work`` completes."""
        self.ensure_open()
        clock = self.clock

        def on_done(_future: Any, c: Collective = collective) -> None:
            if c.completed is None:  # never overwrite a real completion
                # NCCL: an event on the callback's current stream, which waits for the collective's kernel.
                # gloo (CPU or CUDA tensors): the host clock, now that the data has arrived.
                c.completed = clock.mark() if device_completion else clock.host_time()

        try:
            work.get_future().then(on_done)
        except RuntimeError:  # a collective without a future (gloo's reduce_scatter): completion = end of wait
            pass
        self.record.collectives.append(collective)

    def span(self, kind: str, start: Mark) -> None:
        """Close a span of ``kind`` (``exposed`` or ``pack``) that began at ``start``."""
        getattr(self.record, kind).append((start, self.clock.mark()))
