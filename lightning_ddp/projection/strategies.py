"""One training step as a timeline, per strategy; ``STRATEGIES``: what can be simulated, read from the registry.

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
``bucketed_        bucketed with the same buckets; a bucket with a matrix worth compressing (``powersgd_plan``,
powersgd``         the engine's rule) launches: the buffer copy, the gather of its uncompressed elements and
                   their all-reduce, then on the compute stream ``M = G + E`` and ``P = M Q`` per matrix (and the
                   QR of the warm-start ``Q``), then the all-reduce of the ``P``s. When backward is over the engine
                   waits for each bucket in order and *then* runs its second round (not overlapped with
                   backward): write back the uncompressed part, QR of ``P``, ``Q = M^T P``, the all-reduce of the
                   ``Q``s (blocking), ``P Q^T`` into the bucket and the error update ``E = M - P Q^T``. Settings:
                   ``rank``, ``min_compression_rate``. Steady state: the exact warm-up steps (``start_iter``)
                   are not modelled
``zero1``          ZeRO-1 ``reduce_scatter`` schedule: after backward, flags; pack the gradients into a buffer of
                   ``n`` equal segments (padded to the largest owner's bytes, ``buckets.assign_owners``);
                   reduce-scatter; copy the own segment out; optimizer on the owned parameters only (the most
                   loaded rank sets the pace); pack the own parameters; all-gather; unpack every parameter
``ddp``            torch DDP: buckets in gradient-ready order, 1 MiB first then 25 MiB (``buckets.ddp_buckets``),
                   launched in bucket order; every bucket is copied in and out; no flags
``zero2``          ZeRO-2 (NCCL's schedule): the bucketed engine's buckets, each packed into a buffer padded to
                   ``n`` equal shards and reduce-scattered as soon as it fills (overlapped with backward); after
                   backward the optimizer on the own ``1/n``, then per bucket the updated shard all-gathered
                   (exposed) and copied out (``simulate_zero2``)
``fsdp2``          torch ``fully_shard`` per transformer block and on the root (``transformer_blocks``): the
                   root's and then each block's all-gather before its forward and again before its backward,
                   issued one block ahead; each block's reduce-scatter after its backward (overlapped); the
                   optimizer on the shard; nothing after (``simulate_fsdp2``)
=================  ==========================================================================================

Contention (``StepModel.contention``, ``s``; fitted per backend in ``contention``): compute placed while a collective
is in flight runs ``1 + s`` times slower (``Timeline.advance``); the time it adds is ``StepResult.contention_ms``.

Copies run on the compute stream at ``copy_bandwidth_Bps`` (bytes read + bytes written). The division by the
world size is left out (one elementwise pass per gradient, fused into the copies or the kernel in practice), except
in PowerSGD's arithmetic, where every kernel the engine runs is counted as a roofline: ``max(FLOPs /
flops_per_s, bytes moved / copy_bandwidth_Bps)`` (``StepModel.kernel_ms``; at rank 4 every one of them is
memory-bound: a rank-``r`` product reads the fp32 matrix once for ``2 r`` FLOPs per element). Per-kernel launch
latency is not modelled: the engine runs about ten small kernels and two QR factorisations per compressed matrix
from Python.

Outputs (``StepResult``): ``step_ms``; ``compute_only_ms`` (forward + backward + unsharded optimizer: the 1-GPU
step); ``exposed_comm_ms = step_ms - compute_only_ms``, the communication (and copies) not hidden behind compute
(for ``zero1`` it is net of the optimizer time sharding saves); ``comm_share = exposed / step``;
``contention_ms``, the compute time contention added (part of the exposed time); ``waited_comm_ms`` and
``wait_share``, the exposed time without it (what a timer around the waits measures); ``busy_comm_ms``, the time
the communication stream is busy (collectives never overlap each other, so this is
their sum); ``overlap``, the fraction of it hidden behind compute; ``copy_ms``; ``calls``; ``comm_bytes`` (the sizes
of all messages).

To simulate a new algorithm, write ``simulate_<name>(model, bucket_size_mb, **settings) -> StepResult`` (its
settings, keyword arguments with defaults after ``bucket_size_mb``, are the engine settings the model depends on)
and name it in the algorithm's registry entry: ``Algorithm(..., projection="package.module:simulate_<name>")``
(``lightning_ddp.sync.registry``). ``STRATEGIES`` reads the registry each time it is used; ``zero1`` and ``ddp``,
which are not registry algorithms, are the projection's own ``BASELINES``.
"""

from __future__ import annotations

import bisect
import importlib
import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Optional, Sequence

from lightning_ddp.catalogue import format_settings
from lightning_ddp.profile import ComputeProfile, ParamTiming
from lightning_ddp.projection.buckets import MiB, assign_buckets, assign_owners, ddp_buckets
from lightning_ddp.projection.comm import CommCost
from lightning_ddp.sync.registry import ALGORITHMS  # the standard library only

__all__ = [
    "BASELINES",
    "STRATEGIES",
    "Interval",
    "Op",
    "StepModel",
    "StepResult",
    "StrategySpec",
    "Timeline",
    "powersgd_plan",
    "projected_strategies",
    "simulate",
    "unmodelled_algorithms",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives a schedule can issue (``StepModel.collective_ms``)."""

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
    """The two streams of one step. Times in milliseconds.

    ``contention`` (``s``, ``contention.py``): compute that runs while a collective is in flight advances at ``1 /
    (1 + s)`` of its speed, so a compute interval of ``d`` ms entirely under communication lasts ``d (1 + s)``.
    Collectives are issued by the compute stream in program order, so every collective that can overlap a compute
    interval is already on the timeline when that interval is placed (the simulators place work in program order).
    """

    def __init__(self, contention: float = 0.0) -> None:
        if not contention >= 0:
            raise ValueError(f"contention must be >= 0 (compute slowed by 1 + s while a collective runs), got {contention!r}")
        self.contention = contention
        self.intervals: list[Interval] = []
        self.comm_free_ms = 0.0
        self.busy_comm_ms = 0.0
        self.copy_ms = 0.0
        self.contention_ms = 0.0
        self.calls = 0
        self.comm_bytes = 0
        self._comm_spans: list[tuple[float, float]] = []  # busy spans of the comm stream, in time order
        self._comm_ends: list[float] = []

    def advance(self, start_ms: float, work_ms: float) -> float:
        """When ``work_ms`` of compute started at ``start_ms`` ends, slowed by ``1 + contention`` while a collective
        already on the timeline is in flight."""
        if self.contention == 0 or work_ms <= 0:
            return start_ms + max(work_ms, 0.0)
        slow = 1.0 + self.contention
        now, left = start_ms, work_ms
        for a, b in self._comm_spans[bisect.bisect_right(self._comm_ends, start_ms):]:
            if a > now:  # a gap with no collective: full speed
                if left <= a - now:
                    return now + left
                left -= a - now
                now = a
            if left * slow <= b - now:
                return now + left * slow
            left -= (b - now) / slow
            now = b
        return now + left

    def compute(self, label: str, start_ms: float, duration_ms: float, copy: bool = False) -> float:
        """Occupy the compute stream from ``start_ms`` for ``duration_ms`` of work (longer under contention);
        returns the end."""
        end = self.advance(start_ms, duration_ms)
        if end > start_ms:
            self.intervals.append(Interval("compute", label, start_ms, end))
        self.contention_ms += (end - start_ms) - max(duration_ms, 0.0)
        if copy:
            self.copy_ms += max(duration_ms, 0.0)  # the work; its slowdown is in contention_ms
        return end

    def collective(self, label: str, issue_ms: float, duration_ms: float, nbytes: int) -> float:
        """Run a collective issued at ``issue_ms`` after every earlier one; returns its end."""
        start = max(issue_ms, self.comm_free_ms)
        end = start + duration_ms
        self.intervals.append(Interval("comm", label, start, end, int(nbytes)))
        if end > start:
            self._comm_spans.append((start, end))
            self._comm_ends.append(end)
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
    flops_per_s: Optional[float] = None
    """FLOP/s of arithmetic on the compute stream (PowerSGD's products and QR factorisations): the profile's
    forward + backward throughput (``run.profile_flops_per_s``); ``None``: only the bytes they move count."""
    contention: float = 0.0
    """``s``: compute runs ``1 + s`` times slower while a collective is in flight (``contention.py``: the fitted
    values per backend and the command that fits them); 0: communication costs compute nothing."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.copy_bandwidth_Bps > 0:
            raise ValueError(f"copy_bandwidth_Bps must be > 0, got {self.copy_bandwidth_Bps}")
        if self.flops_per_s is not None and not self.flops_per_s > 0:
            raise ValueError(f"flops_per_s must be > 0 or None, got {self.flops_per_s}")
        if not self.contention >= 0:
            raise ValueError(f"contention must be >= 0, got {self.contention!r}; e.g. 0.3 for compute 30 % slower "
                             "while a collective runs")

    def timeline(self) -> Timeline:
        """An empty timeline with this model's contention."""
        return Timeline(self.contention)

    def all_reduce_ms(self, nbytes: float) -> float:
        return 1e3 * self.comm.all_reduce_s(nbytes, self.world_size)

    def collective_ms(self, kind: str, nbytes: float) -> float:
        """``kind``: ``all_reduce``, ``reduce_scatter`` or ``all_gather``."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(COLLECTIVES)}")
        return getattr(self, f"{kind}_ms")(nbytes)

    def reduce_scatter_ms(self, nbytes: float) -> float:
        return 1e3 * self.comm.reduce_scatter_s(nbytes, self.world_size)

    def all_gather_ms(self, nbytes: float) -> float:
        return 1e3 * self.comm.all_gather_s(nbytes, self.world_size)

    def copy_ms(self, bytes_moved: float) -> float:
        """A copy that reads and writes ``bytes_moved`` bytes in total."""
        return 1e3 * bytes_moved / self.copy_bandwidth_Bps

    def kernel_ms(self, flops: float, bytes_moved: float) -> float:
        """One kernel as a roofline: ``max(flops / flops_per_s, bytes_moved / copy_bandwidth_Bps)``."""
        compute = 1e3 * flops / self.flops_per_s if self.flops_per_s else 0.0
        return max(compute, self.copy_ms(bytes_moved))


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
    settings: dict[str, Any] = field(default_factory=dict)
    """The engine settings it was simulated with (``simulate(..., **settings)``), e.g. ``{"rank": 4}``."""
    contention_ms: float = 0.0
    """Compute time added by the contention model (compute slowed while collectives run); part of ``exposed_comm_ms``."""
    memory_bytes: Optional[int] = None
    """Model-state bytes per rank (``projection.memory``); set by ``sweep.project``."""

    @property
    def variant(self) -> str:
        """The strategy with its settings, e.g. ``bucketed_powersgd rank=4`` (tables, best sizes, plots)."""
        return f"{self.strategy} {format_settings(self.settings)}" if self.settings else self.strategy

    @property
    def exposed_comm_ms(self) -> float:
        return self.step_ms - self.compute_only_ms

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def waited_comm_ms(self) -> float:
        """The time the compute stream waited for communication (and spent on copies): exposed minus contention.
        What a timer around the waits measures (the CommTimer, the published runs' "grad all reduce")."""
        return self.exposed_comm_ms - self.contention_ms

    @property
    def wait_share(self) -> float:
        """``waited_comm_ms / step_ms``: the share a timer around the waits reports; ``comm_share`` without contention."""
        return self.waited_comm_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def overlap(self) -> float:
        """The fraction of communication hidden behind compute, ``1 - (exposed - copies) / busy`` clipped to [0, 1].

        As the CommTimer's ``comm/overlap``, whose exposed time leaves buffer copies out; the clip absorbs zero1's
        optimizer saving (its exposed time is net of it) and float dust.
        """
        if self.busy_comm_ms <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (self.waited_comm_ms - self.copy_ms) / self.busy_comm_ms))


def _result(name: str, bucket_size_mb: Optional[float], model: StepModel, t: Timeline, step_ms: float) -> StepResult:
    return StepResult(name, bucket_size_mb, model.world_size, step_ms, model.profile.compute_ms, t.busy_comm_ms,
                      t.copy_ms, t.calls, t.comm_bytes, t.intervals, contention_ms=t.contention_ms)


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
    t = model.timeline()
    _, cursor = _forward_backward(model, t)
    cursor = _presence_flags(model, t, cursor)
    for param in model.profile.params:  # parameters() order, one blocking call each
        if param.ready_ms is not None:
            cursor = t.collective(param.name, cursor, model.all_reduce_ms(param.bytes), param.bytes)
    return _result("naive", None, model, t, _optimizer(model, t, cursor))


def simulate_flat(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    t = model.timeline()
    _, cursor = _forward_backward(model, t)
    cursor = _presence_flags(model, t, cursor)
    nbytes = model.profile.grad_bytes
    cursor = t.compute("pack", cursor, model.copy_ms(2 * nbytes), copy=True)
    cursor = t.collective("flat buffer", cursor, model.all_reduce_ms(nbytes), nbytes)
    cursor = t.compute("unpack", cursor, model.copy_ms(2 * nbytes), copy=True)
    return _result("flat", None, model, t, _optimizer(model, t, cursor))


@dataclass(frozen=True)
class Op:
    """One step of a bucket's reduction: ``ms`` of work on the compute stream (``compute``: a buffer copy, a cast,
    compression arithmetic; counted in ``copy_ms``, as the CommTimer counts them as pack/unpack time), or a
    collective (``op``: all-reduce unless said) of ``nbytes`` (``collective``)."""

    kind: Literal["compute", "collective"]
    label: str
    ms: float = 0.0
    nbytes: int = 0
    op: str = "all_reduce"
    """For a collective: ``all_reduce``, ``reduce_scatter`` or ``all_gather`` (``COLLECTIVES``)."""


def _bucket_schedule(model: StepModel, name: str, bucket_size_mb: Optional[float], buckets: list[list[int]], *,
                     wire_bytes: list[int], pack_ms: list[float], unpack_ms: list[float], presence_flags: bool) -> StepResult:
    """Buckets launched from gradient hooks, strictly in bucket order: each packed, then all-reduced in one call;
    unpacked once waited for (see the module docstring)."""
    labels = [_bucket_label(model, bucket, k) for k, bucket in enumerate(buckets)]
    launch = [[Op("compute", f"pack bucket {k}", pack_ms[k]), Op("collective", labels[k], nbytes=wire_bytes[k])]
              for k in range(len(buckets))]
    finish = [[Op("compute", f"unpack bucket {k}", unpack_ms[k])] for k in range(len(buckets))]
    return _staged_schedule(model, name, bucket_size_mb, buckets, launch=launch, finish=finish,
                            presence_flags=presence_flags)


def _bucket_label(model: StepModel, bucket: list[int], k: int) -> str:
    """As the engines label their collectives: the parameter's name, or the bucket's size."""
    return model.profile.params[bucket[0]].name if len(bucket) == 1 else f"bucket {k} ({len(bucket)} tensors)"


def _staged_schedule(model: StepModel, name: str, bucket_size_mb: Optional[float], buckets: list[list[int]], *,
                     launch: list[list[Op]], finish: list[list[Op]], presence_flags: bool,
                     optimizer_fraction: float = 1.0, after: Sequence[Op] = ()) -> StepResult:
    """Buckets launched from gradient hooks, strictly in bucket order; see the module docstring.

    ``launch[k]``: what launching bucket ``k`` does, in order (its compute delays the rest of backward; its
    collectives are issued, not waited for). ``finish[k]``: what waiting for it does once backward is over, in
    bucket order, after every collective of its launch has ended (a collective here is waited for at once). Then
    the optimizer on ``optimizer_fraction`` of the parameters, then ``after`` (each collective waited for at once).

    Backward is placed piece by piece in program order (up to each launch), so that contention can slow the pieces
    that run beside a collective.
    """
    p, t = model.profile, model.timeline()

    backward_start = t.compute("forward", 0.0, p.forward_ms)
    cursor = backward_start  # the compute stream
    done = 0.0  # backward work done (ms of the profile's backward)
    comm_ends: list[float] = []

    def run(ops: Sequence[Op], cursor: float, wait: bool) -> tuple[float, float]:
        """``ops`` from ``cursor``: (when the compute stream is free again, when the last collective ends)."""
        end = cursor
        for op in ops:
            if op.kind == "compute":
                cursor = t.compute(op.label, cursor, op.ms, copy=True)
            else:  # the stream runs collectives in issue order: the last one issued ends last
                end = t.collective(op.label, cursor, model.collective_ms(op.op, op.nbytes), op.nbytes)
                if wait:
                    cursor = end
        return cursor, end

    b = 0
    for b, bucket in enumerate(buckets):
        ready = [p.params[i].ready_ms for i in bucket]
        if any(r is None for r in ready):
            break  # a gradient that never comes: this bucket (and, in order, every later one) waits for the finish
        if max(ready) > done:
            cursor = t.compute("backward", cursor, max(ready) - done)
            done = max(ready)
        cursor, end = run(launch[b], cursor, wait=False)
        comm_ends.append(end)
    else:
        b = len(buckets)
    cursor = t.compute("backward", cursor, p.backward_span_ms - done)
    for late in range(b, len(buckets)):  # finish_gradient_synchronization: launch what backward did not
        cursor, end = run(launch[late], cursor, wait=False)
        comm_ends.append(end)
    if presence_flags:
        cursor = _presence_flags(model, t, cursor)
    for k, end in enumerate(comm_ends):  # wait for each bucket in order, then finish it
        cursor, _ = run(finish[k], max(cursor, end), wait=True)
    cursor, _ = run(after, _optimizer(model, t, cursor, optimizer_fraction), wait=True)
    return _result(name, bucket_size_mb, model, t, cursor)


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
    p, n, t = model.profile, model.world_size, model.timeline()
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


def _padded(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n``: an element-wise shard of equal size on every rank."""
    return -(-numel // n) * n


def simulate_zero2(model: StepModel, bucket_size_mb: Optional[float] = 25.0) -> StepResult:
    """ZeRO-2 (the module docstring's schedule): the bucketed engine's buckets, each packed into a flat buffer
    padded to a multiple of ``n`` elements and reduce-scattered as soon as it fills (overlapped with the rest of
    backward; each rank keeps ``1/n`` of the averaged gradients, so nothing is unpacked); after backward the
    optimizer on the rank's ``1/n`` shard, then per bucket: the updated shard copied in, all-gathered into the
    padded buffer (exposed: nothing is left to overlap), and copied out into the parameters."""
    p, n = model.profile, model.world_size
    params = p.params
    buckets = _engine_buckets(params, bucket_size_mb)
    launch, finish, after = [], [], []
    padded_total = 0
    for k, bucket in enumerate(buckets):
        label = _bucket_label(model, bucket, k)
        nbytes = sum(params[i].bytes for i in bucket)
        numel = sum(params[i].numel for i in bucket)
        element = nbytes / numel if numel else 4.0
        padded = round(_padded(numel, n) * element)
        padded_total += padded
        launch.append([Op("compute", f"pack bucket {k}", model.copy_ms(2 * nbytes) if n > 1 else 0.0),
                       Op("collective", f"{label} [reduce-scatter]", nbytes=padded, op="reduce_scatter")])
        finish.append([])
        after += [Op("compute", f"pack own shard {k}", model.copy_ms(2 * padded / n) if n > 1 else 0.0),
                  Op("collective", f"{label} [all-gather]", nbytes=padded, op="all_gather"),
                  Op("compute", f"unpack bucket {k}", model.copy_ms(2 * nbytes) if n > 1 else 0.0)]
    grad_bytes = sum(q.bytes for q in params)
    fraction = padded_total / n / grad_bytes if grad_bytes else 1.0
    return _staged_schedule(model, "zero2", bucket_size_mb, buckets, launch=launch, finish=finish,
                            presence_flags=_missing(model), optimizer_fraction=fraction, after=after)


_BLOCK = re.compile(r"^(.*?\b[A-Za-z_]\w*\.\d+)\.")


def transformer_blocks(params: Sequence[ParamTiming]) -> tuple[list[int], list[list[int]]]:
    """``(root, blocks)``: the indices of the parameters outside any block, and of each block's, in forward order.

    A block is what a ``ModuleList`` holds: every parameter whose name starts with ``<name>.<index>.`` (e.g.
    ``blocks.3.attn.qkv.weight``, ``model.blocks.3...``) belongs to block ``<name>.<index>``; ``fully_shard`` is
    applied to each, and once more to the root for everything else (embeddings, final norm, ``lm_head``).

    >>> transformer_blocks([ParamTiming("tok_emb.weight", 4, 16, None), ParamTiming("blocks.0.w", 4, 16, 2.0),
    ...                     ParamTiming("blocks.1.w", 4, 16, 1.0), ParamTiming("lm_head.weight", 4, 16, 0.5)])
    ([0, 3], [[1], [2]])
    """
    root: list[int] = []
    blocks: dict[str, list[int]] = {}
    for i, q in enumerate(params):
        match = _BLOCK.match(q.name)
        if match is None:
            root.append(i)
        else:
            blocks.setdefault(match.group(1), []).append(i)
    return root, list(blocks.values())


def _shard_bytes(params: Sequence[ParamTiming], indices: Sequence[int], n: int) -> int:
    """Bytes of the unsharded, padded buffer of ``indices``: each parameter split on dim 0 across ``n`` ranks as
    ``fully_shard`` does (dim 0 padded to a multiple of ``n``; without a shape, its elements)."""
    total = 0
    for i in indices:
        q = params[i]
        element = q.bytes / q.numel if q.numel else 4.0
        if q.shape:
            rows = q.shape[0]
            total += round(_padded(rows, n) * (q.numel // rows if rows else 0) * element)
        else:
            total += round(_padded(q.numel, n) * element)
    return total


def simulate_fsdp2(model: StepModel, bucket_size_mb: Optional[float] = None) -> StepResult:
    """FSDP2: torch's ``fully_shard`` on each transformer block and on the root (``transformer_blocks``).

    Forward: the root's all-gather, then per block its all-gather, issued one block ahead (block ``i + 1``'s when
    block ``i`` starts) and copied out of the gather buffer before the block runs; the root keeps its parameters
    (the root is not resharded after forward), blocks reshard theirs. Backward: each block's all-gather again,
    one block ahead (the last block's at the start of backward), its backward, its gradients copied into a
    padded buffer and reduce-scattered (overlapped with the next block's backward); the root's reduce-scatter
    after the whole backward. Then the optimizer on the shard (``1/n`` of the padded elements). Nothing after:
    the next forward's all-gathers fetch the updated shards.

    Block times come from the profile: a block's backward is the backward work between the previous block's
    last gradient and its own (``ready_ms``), its forward the same share of ``forward_ms``; the root's split
    around them (lm_head and final norm before the first block's backward, the embedding after the last).
    """
    p, n, t = model.profile, model.world_size, model.timeline()
    params = p.params
    root, blocks = transformer_blocks(params)
    span = p.backward_span_ms
    # the backward work done when each block's last gradient is ready; blocks backward in reverse forward order
    ends = [max((params[i].ready_ms for i in b if params[i].ready_ms is not None), default=span) for b in blocks]
    order = sorted(range(len(blocks)), key=lambda k: ends[k])  # backward order
    head_end = max((params[i].ready_ms for i in root if params[i].ready_ms is not None
                    and (not ends or params[i].ready_ms <= min(ends))), default=0.0)
    backward_ms: dict[int, float] = {}
    previous = head_end
    for k in order:
        backward_ms[k] = max(0.0, ends[k] - previous)
        previous = max(previous, ends[k])
    tail_ms = max(0.0, span - previous)  # the embedding's backward
    scale = p.forward_ms / span if span > 0 else 0.0
    gather = [_shard_bytes(params, b, n) for b in blocks]
    root_bytes = _shard_bytes(params, root, n)
    moved = [sum(params[i].bytes for i in b) for b in blocks]
    root_moved = sum(params[i].bytes for i in root)

    def copy(nbytes: float) -> float:
        return model.copy_ms(2 * nbytes) if n > 1 else 0.0  # one rank: fully_shard gathers nothing

    def all_gather(label: str, issue_ms: float, nbytes: int) -> float:
        return t.collective(f"{label} [all-gather]", issue_ms, model.all_gather_ms(nbytes), nbytes)

    # forward
    cursor = 0.0
    root_ready = all_gather("root", cursor, root_bytes) if root else 0.0
    gathered = {0: all_gather(_group_label(params, blocks[0]), cursor, gather[0])} if blocks else {}
    cursor = t.compute("copy out root", max(cursor, root_ready), copy(root_moved), copy=True)
    cursor = t.compute("forward (embedding)", cursor, scale * tail_ms)
    for k in range(len(blocks)):
        if k + 1 < len(blocks):  # prefetch the next block's parameters
            gathered[k + 1] = all_gather(_group_label(params, blocks[k + 1]), cursor, gather[k + 1])
        cursor = t.compute(f"copy out block {k}", max(cursor, gathered[k]), copy(moved[k]), copy=True)
        cursor = t.compute(f"forward block {k}", cursor, scale * backward_ms[k])
    cursor = t.compute("forward (head)", cursor, scale * head_end)
    # backward
    gathered = {order[0]: all_gather(_group_label(params, blocks[order[0]]), cursor, gather[order[0]])} if blocks else {}
    cursor = t.compute("backward (head)", cursor, head_end)
    last_comm = cursor
    for j, k in enumerate(order):
        if j + 1 < len(order):
            nxt = order[j + 1]
            gathered[nxt] = all_gather(_group_label(params, blocks[nxt]), cursor, gather[nxt])
        cursor = t.compute(f"copy out block {k}", max(cursor, gathered[k]), copy(moved[k]), copy=True)
        cursor = t.compute(f"backward block {k}", cursor, backward_ms[k])
        cursor = t.compute(f"copy in gradients {k}", cursor, copy(moved[k]), copy=True)
        last_comm = t.collective(f"{_group_label(params, blocks[k])} [reduce-scatter]", cursor,
                                 model.reduce_scatter_ms(gather[k]), gather[k])
    cursor = t.compute("backward (embedding)", cursor, tail_ms)
    if root:
        cursor = t.compute("copy in root gradients", cursor, copy(root_moved), copy=True)
        last_comm = t.collective("root [reduce-scatter]", cursor, model.reduce_scatter_ms(root_bytes), root_bytes)
    cursor = max(cursor, last_comm)
    total = sum(q.bytes for q in params)
    fraction = (sum(gather) + root_bytes) / n / total if total else 1.0
    return _result("fsdp2", None, model, t, _optimizer(model, t, cursor, fraction))


def _group_label(params: Sequence[ParamTiming], indices: Sequence[int]) -> str:
    match = _BLOCK.match(params[indices[0]].name)
    return match.group(1) if match else params[indices[0]].name


def powersgd_plan(shapes: Sequence[Optional[tuple[int, ...]]], rank: int,
                  min_compression_rate: float) -> list[Optional[tuple[int, int, int]]]:
    """Per gradient of a bucket, ``(rows, cols, k)`` if the PowerSGD engine compresses it, else ``None``.

    The engine's rule (``lightning_ddp.sync.bucketed_powersgd.plan_bucket``, restated without torch and tested to
    agree): a gradient of ``ndim >= 2`` is the matrix ``(shape[0], prod(shape[1:]))``; with ``k = min(rows, cols,
    rank)`` it is compressed when ``rows * cols > min_compression_rate * (rows + cols) * k``.

    >>> powersgd_plan([(1600, 6400), (1600,), (8, 8)], rank=4, min_compression_rate=2.0)
    [(1600, 6400, 4), None, None]
    """
    plan: list[Optional[tuple[int, int, int]]] = []
    for shape in shapes:
        if shape is None or len(shape) < 2:
            plan.append(None)
            continue
        rows, cols = shape[0], math.prod(shape[1:])
        k = min(rows, cols, rank)
        plan.append((rows, cols, k) if (rows + cols) * k * min_compression_rate < rows * cols else None)
    return plan


def simulate_bucketed_powersgd(model: StepModel, bucket_size_mb: Optional[float] = 25.0, rank: int = 4,
                               min_compression_rate: float = 2.0) -> StepResult:
    """PowerSGD on the bucketed engine's buckets (the module docstring's schedule; the engine's recipe is in
    ``lightning_ddp/sync/bucketed_powersgd.py``), in its steady state: every step compressed, ``E`` and ``Q`` kept.

    Per compressed ``rows x cols`` matrix (``k`` its rank) the kernels the engine runs, each as
    ``StepModel.kernel_ms(FLOPs, bytes read + written)``, with ``g`` the gradient's element size and ``f`` that of
    ``M``, ``E``, ``P``, ``Q`` (fp32, or the gradient's if wider) and ``rc = rows * cols``:

    - launch: ``M = G`` copied (``rc (g + f)`` bytes), ``M += E`` (``3 rc f``), QR of ``Q`` (``2 cols k^2`` FLOPs),
      ``P = M Q`` (``2 rc k`` FLOPs, ``(rc + cols k + rows k) f`` bytes), ``P /= n``;
    - finish: QR of ``P`` (``2 rows k^2``), ``Q = M^T P`` (as ``M Q``), ``Q /= n``; after the ``Q`` round, ``P Q^T``
      (``2 rc k`` FLOPs, writes ``rc f``), copied into the bucket (``rc (f + g)``), ``E = M - P Q^T`` (``rc (2 f + g)``).

    The uncompressed elements (vectors, small matrices, the last bucket's missing-gradient sentinel) are gathered
    (``torch.cat`` and ``/ n``: ``4 g`` bytes each) and written back (``2 g``). Wire bytes per bucket: ``g`` per
    uncompressed element plus ``f (rows + cols) k`` per matrix: ``BucketPlan.sent_numel`` elements.
    """
    p = model.profile
    if not p.has_shapes:
        missing = next(q.name for q in p.params if q.shape is None)
        raise ValueError(
            f"bucketed_powersgd needs every parameter's shape (which gradients are matrices), but the compute profile "
            f"has none for {missing!r}: use a modelled profile (`compute.source: flops`) or one the CommTimer recorded "
            "with shapes, or leave bucketed_powersgd out of `study.strategies`"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank (the PowerSGD approximation rank) must be an int >= 1, got {rank!r}; e.g. rank=4")
    if not min_compression_rate >= 0:
        raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate!r}; e.g. 2.0")
    params = p.params
    buckets = _engine_buckets(params, bucket_size_mb)
    buffered = _buffered(buckets)
    launch: list[list[Op]] = []
    finish: list[list[Op]] = []
    for b, bucket in enumerate(buckets):
        label = _bucket_label(model, bucket, b)
        nbytes = sum(params[i].bytes for i in bucket)
        tensors_numel = sum(params[i].numel for i in bucket)
        numel = tensors_numel + (1 if b == len(buckets) - 1 else 0)  # the last bucket's missing-gradient sentinel
        g = nbytes / tensors_numel if tensors_numel else 4.0  # a bucket holds one dtype
        f = max(g, 4.0)  # M, E, P and Q: fp32 at least
        pack = Op("compute", f"pack bucket {b}", model.copy_ms(2 * nbytes) if buffered[b] else 0.0)
        matrices = [m for m in powersgd_plan([params[i].shape for i in bucket], rank, min_compression_rate) if m]
        if not matrices:  # nothing worth compressing: averaged exactly, as bucketed
            launch.append([pack, Op("collective", label, nbytes=round(numel * g))])
            finish.append([])
            continue
        uncompressed = numel - sum(rows * cols for rows, cols, _ in matrices)
        p_numel = sum(rows * k for rows, _, k in matrices)
        q_numel = sum(cols * k for _, cols, k in matrices)
        kernel = model.kernel_ms
        steps = [pack]
        if uncompressed:
            steps += [Op("compute", f"gather uncompressed {b}", model.copy_ms(4 * uncompressed * g)),
                      Op("collective", f"{label} [uncompressed]", nbytes=round(uncompressed * g))]
        p_ms = sum(kernel(0, rows * cols * (g + f)) + kernel(0, 3 * rows * cols * f)  # M = G (copy); M += E
                   + kernel(2 * cols * k * k, 2 * cols * k * f)  # orthogonalise Q
                   + kernel(2 * rows * cols * k, (rows * cols + cols * k + rows * k) * f)  # P = M Q
                   for rows, cols, k in matrices) + kernel(0, 2 * p_numel * f)  # P /= n
        steps += [Op("compute", f"PowerSGD P {b}", p_ms), Op("collective", f"{label} [PowerSGD P]", nbytes=round(p_numel * f))]
        launch.append(steps)
        q_ms = model.copy_ms(2 * uncompressed * g) + sum(  # write back the uncompressed elements
            kernel(2 * rows * k * k, 2 * rows * k * f)  # orthogonalise P
            + kernel(2 * rows * cols * k, (rows * cols + rows * k + cols * k) * f)  # Q = M^T P
            for rows, cols, k in matrices) + kernel(0, 2 * q_numel * f)  # Q /= n
        decompress_ms = sum(kernel(2 * rows * cols * k, (rows * k + cols * k + rows * cols) * f)  # P Q^T
                            + kernel(0, rows * cols * (f + g))  # into the bucket
                            + kernel(0, rows * cols * (2 * f + g))  # E = M - P Q^T
                            for rows, cols, k in matrices)
        finish.append([Op("compute", f"PowerSGD Q {b}", q_ms), Op("collective", f"{label} [PowerSGD Q]", nbytes=round(q_numel * f)),
                       Op("compute", f"PowerSGD decompress {b}", decompress_ms)])
    return _staged_schedule(model, "bucketed_powersgd", bucket_size_mb, buckets, launch=launch, finish=finish,
                            presence_flags=_missing(model))


# ---- the table: the registry's algorithms with a model, and the projection's own baselines --------------------


@dataclass(frozen=True)
class StrategySpec:
    """A simulated strategy: how to simulate one step, whether it takes a bucket size, what it does."""

    simulate: Callable[..., StepResult]
    """``simulate(model, bucket_size_mb, **settings) -> StepResult``."""
    has_bucket_size: bool
    summary: str

    def settings(self) -> dict[str, Any]:
        """The engine settings the model takes (its keyword arguments after ``bucket_size_mb``) and their defaults."""
        parameters = list(inspect.signature(self.simulate).parameters.values())[2:]
        return {q.name: q.default for q in parameters
                if q.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


BASELINES: dict[str, StrategySpec] = {
    "zero1": StrategySpec(simulate_zero1, False, "ZeRO-1: reduce-scatter, sharded optimizer, all-gather"),
    "ddp": StrategySpec(simulate_ddp, False, "torch DDP: 1 MiB then 25 MiB buckets in gradient-ready order"),
    "zero2": StrategySpec(simulate_zero2, True, "ZeRO-2: each bucket reduce-scattered during backward, sharded "
                          "optimizer, updated parameters all-gathered after it"),
    "fsdp2": StrategySpec(simulate_fsdp2, False, "torch FSDP2 (fully_shard per block): parameters all-gathered "
                          "per block before forward and backward, gradients reduce-scattered per block"),
}
"""The strategies the projection simulates that are not registry algorithms (or not yet): ZeRO-1 (``zero1_ddp``, an
optimizer on top of an engine), torch DDP (the baseline), ZeRO-2 and torch FSDP2. A registry algorithm of the same
name that names no ``projection`` model is projected with the one here."""


def _load(path: str, name: str) -> Callable[..., StepResult]:
    module, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"the projection model of {name!r}, {path!r}, cannot be loaded ({error}); fix `projection` in "
                         "its registry entry (lightning_ddp/sync/registry.py): \"package.module:function\"") from None
    if not callable(function):
        raise ValueError(f"the projection model of {name!r}, {path!r}, is not a function")
    return function


def projected_strategies() -> dict[str, StrategySpec]:
    """Every strategy the projection can simulate, in table order: the registered algorithms with a ``projection``
    (registry order), then ``BASELINES``. Read afresh each call: an algorithm registered later is in it."""
    table = {a.name: StrategySpec(_load(a.projection, a.name), a.has_bucket_size, a.summary)
             for a in ALGORITHMS.values() if a.projection is not None}
    return {**table, **BASELINES}


def unmodelled_algorithms() -> list[str]:
    """Registered algorithms without a projection model (the report names them "not projected")."""
    return [a.name for a in ALGORITHMS.values() if a.projection is None and a.name not in BASELINES]


class _Strategies(Mapping):
    """A live view of ``projected_strategies()``: ``STRATEGIES[name]``, ``name in STRATEGIES``, iteration."""

    def __getitem__(self, name: str) -> StrategySpec:
        return projected_strategies()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(projected_strategies())

    def __len__(self) -> int:
        return len(projected_strategies())

    def __repr__(self) -> str:
        return f"STRATEGIES({', '.join(self)})"


STRATEGIES: Mapping[str, StrategySpec] = _Strategies()
"""Every simulated strategy by name, in the order tables and plots use: the registry's algorithms with a
``projection`` model, then ``zero1`` and ``ddp`` (``projected_strategies``)."""


def strategy_spec(name: str) -> StrategySpec:
    """``STRATEGIES[name]``; an unknown name lists the simulated ones, and says how to model a registered one."""
    table = projected_strategies()
    if name in table:
        return table[name]
    choices = ", ".join(table)
    if name in unmodelled_algorithms():  # registered for training, but nobody wrote its timeline model yet
        raise ValueError(
            f"strategy {name!r} is registered in lightning_ddp/sync/registry.py but has no model in the projection: "
            "add a simulate function (see simulate_bucketed in lightning_ddp/projection/strategies.py) and name it in "
            f"its registry entry's `projection`, or leave it out (projected: {choices})")
    raise ValueError(f"unknown strategy {name!r}; choose from {choices}")


def check_settings(name: str, settings: Mapping[str, Any]) -> None:
    """Refuse settings the model of ``name`` does not take, naming the ones it does."""
    valid = strategy_spec(name).settings()
    for setting in settings:
        if setting not in valid:
            raise ValueError(f"the projection of {name!r} models no setting {setting!r}; its settings are: "
                             f"{', '.join(valid) or 'none'} (an engine setting that does not change the step time is "
                             "not modelled)")


def simulate(name: str, model: StepModel, bucket_size_mb: Optional[float] = None, **settings: Any) -> StepResult:
    """Simulate one step of strategy ``name`` (``bucket_size_mb`` for those that take one, ``settings`` for those
    whose model has them, e.g. ``rank=4``)."""
    spec = strategy_spec(name)
    check_settings(name, settings)
    if spec.has_bucket_size:
        result = spec.simulate(model, 25.0 if bucket_size_mb is None else bucket_size_mb, **settings)
    elif bucket_size_mb is not None:
        raise ValueError(f"strategy {name!r} takes no bucket size, got bucket_size_mb={bucket_size_mb!r}")
    else:
        result = spec.simulate(model, None, **settings)
    result.strategy, result.settings = name, dict(settings)  # an algorithm may reuse another's model
    return result
