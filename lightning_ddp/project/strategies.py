"""One training step as a timeline, per strategy; ``STRATEGIES`` is the one table of what can be simulated.

The machine (``Timeline``): one **compute stream** (forward, backward, buffer copies, optimizer, in program order)
and one **communication stream** on which collectives run in the order they are issued: a collective starts at
``max(issue time, end of the previous collective)`` and lasts what ``StepModel.comm`` says. Waiting for a
collective moves the compute stream to its end. The step ends when the optimizer has finished.

How each strategy issues its collectives (mirroring the engines in ``lightning_ddp.sync`` and torch DDP):

=================  ==========================================================================================
strategy           schedule
=================  ==========================================================================================
``naive``          after backward: gradient-presence flags (a tiny blocking all-reduce), then one blocking
                   all-reduce per gradient in ``parameters()`` order; optimizer
``flat``           after backward: flags; pack every gradient into one buffer (a copy); one all-reduce; unpack;
                   optimizer
``overlap``        during backward: each gradient's async all-reduce, launched when it is ready, strictly in
                   reverse ``parameters()`` order (a gradient ready early waits for its predecessors); at the
                   end: wait, optimizer. In place, except the last bucket, which is copied into its buffer (it
                   carries the missing-gradient sentinel); presence flags only if some gradient never comes
``bucketed``       as overlap with buckets of at most ``bucket_size_mb`` MiB (``buckets.assign_buckets``): a
                   bucket launches once all its gradients are ready and every earlier bucket has launched; a
                   multi-tensor bucket (and the last one) is copied into its persistent buffer on the compute
                   stream first (delaying the rest of backward); nothing is unpacked (the gradients are views of
                   the buffers); one-tensor buckets are reduced in place
``bucketed_bf16``  bucketed with the same buckets (capped on the fp32 gradient bytes), communicated in bf16:
                   half the bytes on the wire, and every bucket pays a cast to bf16 and one back
``zero1``          ZeRO-1 ``reduce_scatter`` schedule: after backward, flags; pack the gradients into a buffer of
                   ``n`` equal segments (padded to the largest owner's bytes, ``buckets.assign_owners``);
                   reduce-scatter; copy the own segment out; optimizer on the owned parameters only (the most
                   loaded rank sets the pace); pack the own parameters; all-gather; unpack every parameter
``ddp``            torch DDP: buckets in gradient-ready order, 1 MiB first then 25 MiB (``buckets.ddp_buckets``),
                   launched in bucket order; every bucket is copied in and out; no flags
=================  ==========================================================================================

Copies run on the compute stream at ``copy_bandwidth_Bps`` (bytes read + bytes written). The division by the
world size is left out (one elementwise pass per gradient, fused into the copies or the kernel in practice).

Outputs (``StepResult``): ``step_ms``; ``compute_only_ms`` (forward + backward + unsharded optimizer: the 1-GPU
step); ``exposed_comm_ms = step_ms - compute_only_ms``, the communication (and copies) not hidden behind compute
(for ``zero1`` it is net of the optimizer time sharding saves); ``comm_share = exposed / step``;
``busy_comm_ms``, the time the communication stream is busy (collectives never overlap each other, so this is
their sum); ``overlap``, the fraction of it hidden behind compute; ``copy_ms``; ``calls``; ``comm_bytes`` (the sizes
of all messages).

To simulate a new strategy, write ``simulate_<name>(model, bucket_size_mb) -> StepResult`` and add it to
``STRATEGIES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from lightning_ddp.project.buckets import MiB, assign_buckets, assign_owners, ddp_buckets
from lightning_ddp.project.comm import CommCost
from lightning_ddp.project.profile import ComputeProfile, ParamTiming

__all__ = ["STRATEGIES", "Interval", "StepModel", "StepResult", "StrategySpec", "Timeline", "simulate"]

PRESENCE_FLAG_BYTES = 4
"""Bytes per parameter of the gradient-presence all-reduce (one int32 flag each)."""


@dataclass(frozen=True)
class Interval:
    """Something that occupied a stream: ``stream`` is ``compute`` or ``comm``; times in ms from the step start."""

    stream: str
    label: str
    start_ms: float
    end_ms: float
    nbytes: int = 0


class Timeline:
    """The two streams of one step. Times in milliseconds."""

    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self.comm_free_ms = 0.0
        self.busy_comm_ms = 0.0
        self.copy_ms = 0.0
        self.calls = 0
        self.comm_bytes = 0

    def compute(self, label: str, start_ms: float, duration_ms: float, copy: bool = False) -> float:
        """Occupy the compute stream from ``start_ms`` for ``duration_ms``; returns the end."""
        end = start_ms + duration_ms
        if duration_ms > 0:
            self.intervals.append(Interval("compute", label, start_ms, end))
        if copy:
            self.copy_ms += duration_ms
        return end

    def collective(self, label: str, issue_ms: float, duration_ms: float, nbytes: int) -> float:
        """Run a collective issued at ``issue_ms`` after every earlier one; returns its end."""
        start = max(issue_ms, self.comm_free_ms)
        end = start + duration_ms
        self.intervals.append(Interval("comm", label, start, end, int(nbytes)))
        self.comm_free_ms = end
        self.busy_comm_ms += duration_ms
        self.calls += 1
        self.comm_bytes += int(nbytes)
        return end


@dataclass(frozen=True)
class StepModel:
    """Everything one simulated step needs: compute profile, communication costs, world size, copy speed."""

    profile: ComputeProfile
    comm: CommCost
    world_size: int
    copy_bandwidth_Bps: float
    """Memory bandwidth of buffer copies (bytes read + written per second)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.copy_bandwidth_Bps > 0:
            raise ValueError(f"copy_bandwidth_Bps must be > 0, got {self.copy_bandwidth_Bps}")

    def all_reduce_ms(self, nbytes: float) -> float:
        return 1e3 * self.comm.all_reduce_s(nbytes, self.world_size)

    def reduce_scatter_ms(self, nbytes: float) -> float:
        return 1e3 * self.comm.reduce_scatter_s(nbytes, self.world_size)

    def all_gather_ms(self, nbytes: float) -> float:
        return 1e3 * self.comm.all_gather_s(nbytes, self.world_size)

    def copy_ms(self, bytes_moved: float) -> float:
        """A copy that reads and writes ``bytes_moved`` bytes in total."""
        return 1e3 * bytes_moved / self.copy_bandwidth_Bps


@dataclass
class StepResult:
    """One simulated step of one strategy (module docstring)."""

    strategy: str
    bucket_size_mb: Optional[float]
    world_size: int
    step_ms: float
    compute_only_ms: float
    busy_comm_ms: float
    copy_ms: float
    calls: int
    comm_bytes: int
    intervals: list[Interval] = field(default_factory=list, repr=False)

    @property
    def exposed_comm_ms(self) -> float:
        return self.step_ms - self.compute_only_ms

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def overlap(self) -> float:
        """The fraction of communication hidden behind compute, ``1 - (exposed - copies) / busy`` clipped to [0, 1].

        As the CommTimer's ``comm/overlap``, whose exposed time leaves buffer copies out; the clip absorbs zero1's
        optimizer saving (its exposed time is net of it) and float dust.
        """
        if self.busy_comm_ms <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (self.exposed_comm_ms - self.copy_ms) / self.busy_comm_ms))


def _result(name: str, bucket_size_mb: Optional[float], model: StepModel, t: Timeline, step_ms: float) -> StepResult:
    return StepResult(name, bucket_size_mb, model.world_size, step_ms, model.profile.compute_ms, t.busy_comm_ms,
                      t.copy_ms, t.calls, t.comm_bytes, t.intervals)


def _forward_backward(model: StepModel, t: Timeline) -> tuple[float, float]:
    """Forward then backward with no hooks; returns (start of backward, end of backward)."""
    p = model.profile
    backward_start = t.compute("forward", 0.0, p.forward_ms)
    return backward_start, t.compute("backward", backward_start, p.backward_span_ms)


def _presence_flags(model: StepModel, t: Timeline, issue_ms: float) -> float:
    """The engines' tiny blocking all-reduce of "which parameters have a gradient here"; returns its end."""
    nbytes = PRESENCE_FLAG_BYTES * len(model.profile.params)
    return t.collective("gradient presence flags", issue_ms, model.all_reduce_ms(nbytes), nbytes)


def _optimizer(model: StepModel, t: Timeline, start_ms: float, fraction: float = 1.0) -> float:
    return t.compute("optimizer", start_ms, model.profile.optimizer_ms * fraction)


# ---- the strategies ------------------------------------------------------------------------------------------


def simulate_naive(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    t = Timeline()
    _, cursor = _forward_backward(model, t)
    cursor = _presence_flags(model, t, cursor)
    for param in model.profile.params:  # parameters() order, one blocking call each
        if param.ready_ms is not None:
            cursor = t.collective(param.name, cursor, model.all_reduce_ms(param.bytes), param.bytes)
    return _result("naive", None, model, t, _optimizer(model, t, cursor))


def simulate_flat(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    t = Timeline()
    _, cursor = _forward_backward(model, t)
    cursor = _presence_flags(model, t, cursor)
    nbytes = model.profile.grad_bytes
    cursor = t.compute("pack", cursor, model.copy_ms(2 * nbytes), copy=True)
    cursor = t.collective("flat buffer", cursor, model.all_reduce_ms(nbytes), nbytes)
    cursor = t.compute("unpack", cursor, model.copy_ms(2 * nbytes), copy=True)
    return _result("flat", None, model, t, _optimizer(model, t, cursor))


def _bucket_schedule(model: StepModel, name: str, bucket_size_mb: Optional[float], buckets: list[list[int]], *,
                     wire_bytes: list[int], pack_ms: list[float], unpack_ms: list[float], presence_flags: bool) -> StepResult:
    """Buckets launched from gradient hooks, strictly in bucket order; see the module docstring."""
    p, t = model.profile, Timeline()

    def label(k: int) -> str:  # as the engines label their collectives: the parameter's name, or the bucket's size
        return p.params[buckets[k][0]].name if len(buckets[k]) == 1 else f"bucket {k} ({len(buckets[k])} tensors)"

    backward_start = t.compute("forward", 0.0, p.forward_ms)
    shift = 0.0  # compute time inserted into backward by packing (it delays every later gradient)
    previous_launch_done = backward_start
    comm_ends: list[float] = []
    b = 0
    for b, bucket in enumerate(buckets):
        ready = [p.params[i].ready_ms for i in bucket]
        if any(r is None for r in ready):
            break  # a gradient that never comes: this bucket (and, in order, every later one) waits for the finish
        launch = max(backward_start + max(ready) + shift, previous_launch_done)
        previous_launch_done = t.compute(f"pack bucket {b}", launch, pack_ms[b], copy=True)
        shift += pack_ms[b]
        comm_ends.append(t.collective(label(b), previous_launch_done, model.all_reduce_ms(wire_bytes[b]), wire_bytes[b]))
    else:
        b = len(buckets)
    t.compute("backward", backward_start, p.backward_span_ms)  # drawn as one interval; the packs sit inside it
    cursor = max(backward_start + p.backward_span_ms + shift, previous_launch_done)
    for late in range(b, len(buckets)):  # finish_gradient_synchronization: launch what backward did not
        cursor = t.compute(f"pack bucket {late}", cursor, pack_ms[late], copy=True)
        comm_ends.append(t.collective(label(late), cursor, model.all_reduce_ms(wire_bytes[late]), wire_bytes[late]))
    if presence_flags:
        cursor = _presence_flags(model, t, cursor)
    for k, end in enumerate(comm_ends):  # wait for each bucket in order, then unpack it
        cursor = t.compute(f"unpack bucket {k}", max(cursor, end), unpack_ms[k], copy=True)
    return _result(name, bucket_size_mb, model, t, _optimizer(model, t, cursor))


def _cap_bytes(bucket_size_mb: Optional[float]) -> Optional[int]:
    if bucket_size_mb is None:
        return None
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be > 0 MiB, got {bucket_size_mb!r}")
    return int(bucket_size_mb * MiB)


def _buffered(buckets: list[list[int]]) -> list[bool]:
    """Which buckets the engine copies into a buffer: every multi-tensor bucket, and the last (the sentinel's)."""
    return [len(bucket) > 1 or k == len(buckets) - 1 for k, bucket in enumerate(buckets)]


def _missing(model: StepModel) -> bool:
    """Whether some gradient never comes (the bucketed engines then all-reduce the presence flags)."""
    return any(q.ready_ms is None for q in model.profile.params)


def _engine_buckets(params: Sequence[ParamTiming], bucket_size_mb: Optional[float]) -> list[list[int]]:
    """The bucketed engines' own assignment (``lightning_ddp.sync.assignment``); a profile's gradients share one
    dtype, so only the cap closes a bucket."""
    return assign_buckets([q.bytes for q in params], [None] * len(params), _cap_bytes(bucket_size_mb))


def simulate_bucketed(model: StepModel, bucket_size_mb: Optional[float] = 25.0) -> StepResult:
    params = model.profile.params
    buckets = _engine_buckets(params, bucket_size_mb)
    sizes = [sum(params[i].bytes for i in bucket) for bucket in buckets]
    # copied into the buffer (read + write) once; the gradients are views of it afterwards: no unpack
    copies = [model.copy_ms(2 * s) if buffered else 0.0 for s, buffered in zip(sizes, _buffered(buckets))]
    return _bucket_schedule(model, "bucketed", bucket_size_mb, buckets, wire_bytes=sizes, pack_ms=copies,
                            unpack_ms=[0.0] * len(buckets), presence_flags=_missing(model))


def simulate_overlap(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    result = simulate_bucketed(model, bucket_size_mb=1 / MiB)  # a 1-byte cap: one bucket per parameter, as OverlapDDP
    result.strategy, result.bucket_size_mb = "overlap", None
    return result


def simulate_bucketed_bf16(model: StepModel, bucket_size_mb: Optional[float] = 25.0) -> StepResult:
    params = model.profile.params
    buckets = _engine_buckets(params, bucket_size_mb)
    numels = [sum(params[i].numel for i in bucket) for bucket in buckets]
    sizes = [sum(params[i].bytes for i in bucket) for bucket in buckets]
    wire = [2 * n for n in numels]  # bf16 on the wire
    buffered = _buffered(buckets)
    # the copy into the buffer (as bucketed), then the cast to bf16 (read s, write w); on the way back the cast into
    # the buffer (read w, write s). Gradients already in bf16 are not cast.
    packs = [(model.copy_ms(2 * s) if b else 0.0) + (model.copy_ms(s + w) if s != w else 0.0)
             for s, w, b in zip(sizes, wire, buffered)]
    unpacks = [model.copy_ms(s + w) if s != w else 0.0 for s, w in zip(sizes, wire)]
    return _bucket_schedule(model, "bucketed_bf16", bucket_size_mb, buckets, wire_bytes=wire, pack_ms=packs,
                            unpack_ms=unpacks, presence_flags=_missing(model))


def simulate_ddp(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    params = model.profile.params
    never = float("inf")
    # gradient-ready order (ties: reverse parameters() order, the autograd order); no-gradient parameters last
    order = sorted(reversed(range(len(params))), key=lambda i: never if params[i].ready_ms is None else params[i].ready_ms)
    buckets = ddp_buckets([q.bytes for q in params], order)
    sizes = [sum(params[i].bytes for i in bucket) for bucket in buckets]
    copies = [model.copy_ms(2 * s) for s in sizes]  # DDP copies every gradient into its bucket and back
    return _bucket_schedule(model, "ddp", None, buckets, wire_bytes=sizes, pack_ms=copies, unpack_ms=copies,
                            presence_flags=False)


def simulate_zero1(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    p, n, t = model.profile, model.world_size, Timeline()
    _, cursor = _forward_backward(model, t)
    cursor = _presence_flags(model, t, cursor)
    synced = [q for q in p.params if q.ready_ms is not None]
    nbytes = sum(q.bytes for q in synced)
    owners = assign_owners([q.bytes for q in synced], n)
    loads = [0] * n
    for q, owner in zip(synced, owners):
        loads[owner] += q.bytes
    segment = max(loads)  # every rank's segment is padded to the largest (reduce-scatter needs equal chunks)
    buffer = n * segment
    cursor = t.compute("pack gradients", cursor, model.copy_ms(nbytes + buffer), copy=True)
    cursor = t.collective("reduce-scatter gradients", cursor, model.reduce_scatter_ms(buffer), buffer)
    cursor = t.compute("unpack own gradients", cursor, model.copy_ms(2 * segment), copy=True)
    cursor = _optimizer(model, t, cursor, fraction=segment / nbytes if nbytes else 1.0)
    cursor = t.compute("pack own parameters", cursor, model.copy_ms(2 * segment), copy=True)
    cursor = t.collective("all-gather parameters", cursor, model.all_gather_ms(buffer), buffer)
    cursor = t.compute("unpack parameters", cursor, model.copy_ms(buffer + nbytes), copy=True)
    return _result("zero1", None, model, t, cursor)


# ---- the table -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategySpec:
    """A simulated strategy: how to simulate one step, and whether it takes a bucket size."""

    simulate: Callable[[StepModel, Optional[float]], StepResult]
    has_bucket_size: bool
    summary: str


STRATEGIES: dict[str, StrategySpec] = {
    "naive": StrategySpec(simulate_naive, False, "after backward, one blocking all-reduce per gradient"),
    "flat": StrategySpec(simulate_flat, False, "after backward, one all-reduce of all gradients packed together"),
    "overlap": StrategySpec(simulate_overlap, False, "during backward, an all-reduce per gradient, in reverse order"),
    "bucketed": StrategySpec(simulate_bucketed, True, "during backward, an all-reduce per size-capped bucket"),
    "bucketed_bf16": StrategySpec(simulate_bucketed_bf16, True, "bucketed, communicated in bf16"),
    "zero1": StrategySpec(simulate_zero1, False, "ZeRO-1: reduce-scatter, sharded optimizer, all-gather"),
    "ddp": StrategySpec(simulate_ddp, False, "torch DDP: 1 MiB then 25 MiB buckets in gradient-ready order"),
}
"""Every simulated strategy by name, in the order tables and plots use. The names are the project's algorithms'."""


def simulate(name: str, model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    """Simulate one step of strategy ``name`` (``bucket_size_mb`` for those that take one)."""
    try:
        spec = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a simulated strategy; choose from {', '.join(STRATEGIES)}") from None
    if spec.has_bucket_size:
        return spec.simulate(model, 25.0 if bucket_size_mb is None else bucket_size_mb)
    if bucket_size_mb is not None:
        raise ValueError(f"strategy {name!r} takes no bucket size, got bucket_size_mb={bucket_size_mb!r}")
    return spec.simulate(model, None)
