"""One training step per strategy on a ``Timeline`` (a compute stream, a FIFO communication stream): from the
catalogue entry's facts (``projection="schedule"``) or its hook ``simulate_<name>(model, bucket_size_mb, **settings)``
(docs/projection.md, "The timeline, strategy by strategy" and "Adding a model")."""

from __future__ import annotations

import bisect
import functools
import inspect
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Literal, NamedTuple, Optional, Sequence

from lightning_ddp import catalogue
from lightning_ddp.profile import ComputeProfile, ParamTiming
from lightning_ddp.projection.comm import CommCost, Fabric
from lightning_ddp.sync.assignment import assign_buckets, assign_owners
from lightning_ddp.sync.memory_model import (
    ADAM_MOMENTS, MiB, bucket_cap_bytes, dim0_shard_numel, fully_sharded_unsharded_peak, owns_buffer, sentinel_numel,
)

PRESENCE_FLAG_BYTES = 4
"""Bytes per parameter of the gradient-presence all-reduce (one int32 flag each)."""

DDP_FIRST_BUCKET_BYTES = 1 * MiB
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: a small first (last-layer) bucket starts communication early."""
DDP_BUCKET_CAP_BYTES = int(catalogue.DEFAULT_BUCKET_SIZE_MB * MiB)
"""torch DDP's default ``bucket_cap_mb``."""

CONTENTION: dict[str, float] = {"gloo": 1.0, "nccl": 0.36}
"""Fitted contention ``s`` per backend: compute slowed while collectives run (what ``python -m
lightning_ddp.projection.contention`` prints; ``test_project.py`` refits it)."""

CPU_COPY_GBPS = 24.03
"""Copy bandwidth of the CPU validation (GB/s read + written, measured once on the sweep's machine and recorded in
``benchmarks/results/projection/cpu_sweep_validation.md``); fixed so that the fit is reproducible anywhere."""


@dataclass(frozen=True)
class Interval:
    """Something that occupied a stream: ``stream`` is ``compute`` or ``comm``; times in ms from the step start."""

    stream: str
    label: str
    """What ran: a parameter's or bucket's name, or a compute phase (``backward``, ``pack bucket 3``)."""
    start_ms: float
    end_ms: float
    nbytes: int = 0
    """Bytes of a collective's message; 0 on the compute stream."""


class Timeline:
    """The two streams of one step of ``model``, times in ms; compute beside a collective runs ``1 + contention``
    times slower."""

    def __init__(self, model: StepModel) -> None:
        self.model = model
        self.step = StepResult(strategy="", bucket_size_mb=None, world_size=model.world_size, step_ms=0.0,
                               compute_only_ms=model.profile.compute_ms, busy_comm_ms=0.0, copy_ms=0.0, calls=0,
                               comm_bytes=0)
        """What the step has cost so far (its ``step_ms`` is set when it ends)."""
        self.comm_free_ms = 0.0
        self._comm_spans: list[tuple[float, float]] = []  # busy spans of the comm stream, in time order

    def advance(self, start_ms: float, work_ms: float) -> float:
        """When ``work_ms`` of compute started at ``start_ms`` ends, slowed by ``1 + contention`` while a collective
        already on the timeline is in flight."""
        if self.model.contention == 0 or work_ms <= 0:
            return start_ms + max(work_ms, 0.0)
        slow = 1.0 + self.model.contention
        now, left = start_ms, work_ms
        for a, b in self._comm_spans[bisect.bisect_right(self._comm_spans, start_ms, key=lambda span: span[1]):]:
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
        """Occupy the compute stream from ``start_ms`` for ``duration_ms`` of work; returns the end."""
        end = self.advance(start_ms, duration_ms)
        if end > start_ms:
            self.step.intervals.append(Interval("compute", label, start_ms, end))
        self.step.contention_ms += (end - start_ms) - max(duration_ms, 0.0)
        if copy:
            self.step.copy_ms += max(duration_ms, 0.0)  # the work; its slowdown is in contention_ms
        return end

    def collective(self, label: str, issue_ms: float, nbytes: int, kind: str = "all_reduce") -> float:
        """Run a collective ``kind`` (``all_reduce``, ``reduce_scatter``, ``all_gather``) of ``nbytes`` issued at
        ``issue_ms`` after every earlier one; returns its end."""
        duration_ms = 1e3 * self.model.comm.collective_s(kind, nbytes, self.model.world_size)
        start = max(issue_ms, self.comm_free_ms)
        end = start + duration_ms
        self.step.intervals.append(Interval("comm", label, start, end, int(nbytes)))
        if end > start:
            self._comm_spans.append((start, end))
        self.comm_free_ms = end
        self.step.busy_comm_ms += duration_ms
        self.step.calls += 1
        self.step.comm_bytes += int(nbytes)
        return end


@dataclass(frozen=True)
class StepModel:
    """Everything one simulated step needs: compute profile, communication costs, world size, copy speed."""

    profile: ComputeProfile
    """The measured single-rank step: forward, backward with each gradient's ready time, optimizer."""
    comm: CommCost
    """Seconds per collective: a ``Fabric``, a ``MeasuredFit``'s fabric or ``HybridComm``."""
    world_size: int
    """Ranks of the simulated step (every collective's ``n``)."""
    copy_bandwidth_Bps: float
    """Memory bandwidth of buffer copies (bytes read + written per second)."""
    flops_per_s: Optional[float] = None
    """FLOP/s of the compute stream's arithmetic (PowerSGD's); ``None``: only the bytes they move count."""
    contention: float = 0.0
    """``s``: compute runs ``1 + s`` times slower while a collective is in flight (``CONTENTION``)."""

    def copy_ms(self, bytes_moved: float) -> float:
        """A copy that reads and writes ``bytes_moved`` bytes in total."""
        return 1e3 * bytes_moved / self.copy_bandwidth_Bps

    def kernel_ms(self, flops: float, bytes_moved: float) -> float:
        """One kernel as a roofline: ``max(flops / flops_per_s, bytes_moved / copy_bandwidth_Bps)``."""
        compute = 1e3 * flops / self.flops_per_s if self.flops_per_s else 0.0
        return max(compute, self.copy_ms(bytes_moved))


@dataclass
class StepResult:
    """One simulated step of one strategy (docs/projection.md)."""

    strategy: str
    """The catalogue name it simulated, e.g. ``bucketed_ddp``."""
    bucket_size_mb: Optional[float]
    """The bucket cap in MiB it was simulated with; ``None``: the strategy takes no bucket size."""
    world_size: int
    step_ms: float
    """The simulated step, ms: when its last operation (the optimizer, or a collective waited for after it) ends."""
    compute_only_ms: float
    """The profile's step without any communication (``ComputeProfile.compute_ms``)."""
    busy_comm_ms: float
    """Sum of every collective's duration, overlapped or not, ms."""
    copy_ms: float
    """Work of buffer copies (pack, unpack, casts) before contention, ms; the CommTimer's pack time."""
    calls: int
    """Collectives launched in the step."""
    comm_bytes: int
    """Bytes of all the step's collectives' messages (per rank, not per wire hop)."""
    intervals: list[Interval] = field(default_factory=list, repr=False)
    """Every interval of both streams, in the order they were placed (what the tests check a schedule by)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The engine settings it was simulated with (``simulate(..., **settings)``), e.g. ``{"rank": 4}``."""
    contention_ms: float = 0.0
    """Compute time added by contention (compute slowed while collectives run); part of ``exposed_comm_ms``."""
    memory_bytes: Optional[int] = None
    """Model-state bytes on the most loaded rank: parameters, gradients, AdamW state, engine buffers."""

    @property
    def variant(self) -> str:
        """The strategy with its settings, e.g. ``bucketed_powersgd rank=4`` (tables, best sizes, plots)."""
        return f"{self.strategy} {catalogue.format_settings(self.settings)}" if self.settings else self.strategy

    @property
    def exposed_comm_ms(self) -> float:
        """What communication adds to the compute-only step: waits and contention, ms."""
        return self.step_ms - self.compute_only_ms

    @property
    def comm_share(self) -> float:
        """``exposed_comm_ms`` as a fraction of the step (0 for an empty step)."""
        return self.exposed_comm_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def waited_comm_ms(self) -> float:
        """Exposed minus contention: what a timer around the waits measures (the CommTimer's)."""
        return self.exposed_comm_ms - self.contention_ms

    @property
    def wait_share(self) -> float:
        """``waited_comm_ms`` as a fraction of the step (0 for an empty step)."""
        return self.waited_comm_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def overlap(self) -> float:
        """``1 - (waited - copies) / busy`` clipped to [0, 1], as the CommTimer's ``comm/overlap``."""
        if self.busy_comm_ms <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (self.waited_comm_ms - self.copy_ms) / self.busy_comm_ms))


def best_by_world_size(results: Iterable[StepResult]) -> dict[tuple[str, int], StepResult]:
    """``(StepResult.variant, world size) -> result`` with the shortest step over bucket sizes."""
    best: dict[tuple[str, int], StepResult] = {}
    for r in results:
        key = (r.variant, r.world_size)
        if key not in best or r.step_ms < best[key].step_ms:
            best[key] = r
    return best


# ---- the strategies ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One step of a schedule: ``ms`` of work on the compute stream (counted in ``copy_ms``, as the CommTimer's
    pack/unpack time, if ``copy``), started once the latest collective labelled ``waits`` (if any) has ended; or a
    collective ``op`` of ``nbytes``."""

    kind: Literal["compute", "collective"]
    label: str
    ms: float = 0.0
    nbytes: int = 0
    op: str = "all_reduce"  # or reduce_scatter, all_gather
    copy: bool = True
    waits: str = ""


def _bucket_schedule(model: StepModel, buckets: list[list[int]], *, wire_bytes: list[int], pack_ms: list[float],
                     unpack_ms: list[float], presence_flags: bool, memory_bytes: int) -> StepResult:
    """Each bucket packed, then all-reduced in one call; unpacked once waited for."""
    launch = []
    for k, bucket in enumerate(buckets):
        launch.append([Op("compute", f"pack bucket {k}", pack_ms[k]),
                       Op("collective", _bucket_label(model, bucket, k), nbytes=wire_bytes[k])])
    finish = [[Op("compute", f"unpack bucket {k}", ms)] for k, ms in enumerate(unpack_ms)]
    return _staged_schedule(model, _ready(model, buckets), launch=launch, finish=finish,
                            presence_flags=presence_flags, memory_bytes=memory_bytes)


def _bucket_label(model: StepModel, bucket: list[int], k: int) -> str:
    """As the engines label their collectives: the parameter's name, or the bucket's size."""
    return model.profile.params[bucket[0]].name if len(bucket) == 1 else f"bucket {k} ({len(bucket)} tensors)"


def _ready(model: StepModel, buckets: list[list[int]]) -> list[Optional[float]]:
    """When each bucket's last gradient is ready (ms of backward work), ``None`` if one never comes."""
    ready = [[model.profile.params[i].ready_ms for i in bucket] for bucket in buckets]
    return [None if None in times else max(times) for times in ready]


def _staged_schedule(model: StepModel, ready: Sequence[Optional[float]], *,
                     launch: Sequence[Sequence[Op]] = (), finish: Sequence[Sequence[Op]] = (), presence_flags: bool,
                     before: Sequence[Op] = (), optimizer_fraction: float = 1.0, after: Sequence[Op] = (),
                     forward: Optional[Sequence[Op]] = None, memory_bytes: Optional[int] = None) -> StepResult:
    """Buckets launched from gradient hooks, strictly in bucket order (no buckets: a sync after backward).

    ``forward`` (default: the profile's forward), then backward placed up to each bucket's ``ready`` time (``None``:
    launched after backward, as every later bucket). ``launch[k]``: what launching bucket ``k`` does (its compute
    delays the rest of backward; its collectives are issued, not waited for). ``finish[k]``: what waiting for it
    does once backward is over. Then ``before``, the optimizer on ``optimizer_fraction`` of the parameters, then
    ``after`` (each collective waited for at once). ``memory_bytes``: the step's model state per rank.
    """
    p, t = model.profile, Timeline(model)
    ends: dict[str, float] = {}  # label -> end of the latest collective with it

    def run(ops: Sequence[Op], cursor: float, wait: bool) -> tuple[float, float]:
        """``ops`` from ``cursor``: (when the compute stream is free again, when the last collective ends)."""
        end = cursor
        for op in ops:
            if op.kind == "compute":
                start = max(cursor, ends[op.waits]) if op.waits else cursor
                cursor = t.compute(op.label, start, op.ms, copy=op.copy)
            else:  # the stream runs collectives in issue order: the last one issued ends last
                end = ends[op.label] = t.collective(op.label, cursor, op.nbytes, op.op)
                if wait:
                    cursor = end
        return cursor, end

    cursor, _ = run(forward or [Op("compute", "forward", p.forward_ms, copy=False)], 0.0, wait=False)
    done = 0.0  # backward work done (ms of the profile's backward)
    comm_ends: list[float] = []
    late = False  # a gradient that never comes: its bucket and, in order, every later one launch after backward
    for k, ready_ms in enumerate(ready):
        late = late or ready_ms is None
        until = p.backward_span_ms if late else ready_ms
        if until > done:
            cursor = t.compute("backward", cursor, until - done)
            done = until
        cursor, end = run(launch[k], cursor, wait=False)
        comm_ends.append(end)
    cursor = t.compute("backward", cursor, p.backward_span_ms - done)
    if presence_flags:  # the engines' tiny blocking all-reduce of "which parameters have a gradient here"
        cursor = t.collective("gradient presence flags", cursor, PRESENCE_FLAG_BYTES * len(p.params))
    for k, end in enumerate(comm_ends):  # wait for each bucket in order, then finish it (if ``finish`` says how)
        cursor, _ = run(finish[k] if finish else (), max(cursor, end), wait=True)
    cursor, _ = run(before, cursor, wait=True)
    cursor, _ = run(after, t.compute("optimizer", cursor, p.optimizer_ms * optimizer_fraction), wait=True)
    # ``simulate`` names its strategy, bucket size and settings
    return replace(t.step, step_ms=cursor, memory_bytes=memory_bytes)


def _bytes(params: Sequence[ParamTiming], indices: Optional[Iterable[int]] = None) -> int:
    """Bytes of the parameters at ``indices`` (``None``: all of them)."""
    if indices is None:
        indices = range(len(params))
    return sum(params[i].bytes for i in indices)


def _replicated(model: StepModel, buffers: int = 0) -> int:
    """Model state of an unsharded strategy: parameters, gradients and AdamW state, plus ``buffers`` bytes."""
    return (2 + ADAM_MOMENTS) * _bytes(model.profile.params) + buffers


def _buffered(buckets: list[list[int]]) -> list[bool]:
    """Which buckets the engine copies into a buffer (``memory_model.owns_buffer``: several tensors, or the last)."""
    return [owns_buffer(k, len(buckets), len(bucket)) for k, bucket in enumerate(buckets)]


def _missing(model: StepModel) -> bool:
    """Whether some gradient never comes (the bucketed engines then all-reduce the presence flags)."""
    return any(q.ready_ms is None for q in model.profile.params)


def _engine_buckets(params: Sequence[ParamTiming], bucket_size_mb: Optional[float]) -> list[list[int]]:
    """The bucketed engines' own assignment; a profile's gradients share one dtype, so only the cap closes one."""
    if bucket_size_mb is not None and not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be > 0 MiB, got {bucket_size_mb!r}")
    return assign_buckets([q.bytes for q in params], [None] * len(params), bucket_cap_bytes(bucket_size_mb))


def simulate_bucketed_bf16(model: StepModel, bucket_size_mb: Optional[float] = 25.0) -> StepResult:
    """The hook of ``bucketed_bf16_ddp``: the bucketed schedule with the wire in bf16."""
    return _bucketed(model, bucket_size_mb, bf16=True)


def _bucketed(model: StepModel, bucket_size_mb: Optional[float], bf16: bool) -> StepResult:
    """The bucketed engine: each buffered bucket copied in once (the gradients are views of it afterwards: no unpack);
    with ``bf16``, sent in bf16: cast to it (read s, write w) after the copy and back (read w, write s) at the finish
    (gradients already in bf16 are not cast), its half-width copy kept per bucket."""
    params = model.profile.params
    buckets = _engine_buckets(params, bucket_size_mb)
    wire, casts, packs = [], [], []
    buffers = 0
    for bucket, buffered in zip(buckets, _buffered(buckets)):
        size = _bytes(params, bucket)
        wire_size = 2 * sum(params[i].numel for i in bucket) if bf16 else size
        cast_ms = model.copy_ms(size + wire_size) if size != wire_size else 0.0
        copy_ms = model.copy_ms(2 * size) if buffered else 0.0
        wire.append(wire_size)
        casts.append(cast_ms)
        packs.append(copy_ms + cast_ms)
        if buffered:
            buffers += size
    if bf16:
        buffers += sum(wire)  # the half-width copy of every bucket
    return _bucket_schedule(model, buckets, wire_bytes=wire, pack_ms=packs, unpack_ms=casts,
                            presence_flags=_missing(model), memory_bytes=_replicated(model, buffers))


def ddp_buckets(nbytes: Sequence[int], order: Sequence[int], first_cap_bytes: int = DDP_FIRST_BUCKET_BYTES,
                cap_bytes: int = DDP_BUCKET_CAP_BYTES) -> list[list[int]]:
    """torch DDP's rule (``compute_bucket_assignment_by_size`` in ``reducer.cpp``) over parameters in gradient-ready
    ``order``: add the tensor, then close the bucket if it reached ``first_cap_bytes`` (the first) or ``cap_bytes``.

    >>> ddp_buckets([16, 16, 16, 48, 4, 4], order=range(6), first_cap_bytes=8, cap_bytes=32)
    [[0], [1, 2], [3], [4, 5]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in order:
        current.append(index)
        current_bytes += nbytes[index]
        if current_bytes >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def _torch_ddp(model: StepModel) -> StepResult:
    """torch DDP: its own buckets in gradient-ready order, every gradient copied into its bucket and back."""
    params = model.profile.params

    def ready_ms(index: int) -> float:
        """When parameter ``index``'s gradient is ready; one that never comes, last."""
        return math.inf if params[index].ready_ms is None else params[index].ready_ms

    # gradient-ready order (ties: reverse parameters() order, the autograd order)
    order = sorted(reversed(range(len(params))), key=ready_ms)
    buckets = ddp_buckets([q.bytes for q in params], order)
    sizes = [_bytes(params, bucket) for bucket in buckets]
    copies = [model.copy_ms(2 * s) for s in sizes]  # DDP copies every gradient into its bucket and back
    return _bucket_schedule(model, buckets, wire_bytes=sizes, pack_ms=copies, unpack_ms=copies,
                            presence_flags=False, memory_bytes=_replicated(model, sum(sizes)))  # the reducer's buckets


def _after_backward(model: StepModel, layout: str) -> StepResult:
    """The engines that sync after backward, by their buffers: ``none`` (a blocking all-reduce per gradient, in
    ``parameters()`` order), ``packed`` (one flat buffer) or ``zero1`` (reduce-scatter, then all-gather after the
    optimizer on the own segment)."""
    before: list[Op] = []
    after: list[Op] = []
    fraction = 1.0
    memory = _replicated(model)
    if layout == "none":
        before = [Op("collective", q.name, nbytes=q.bytes) for q in model.profile.params if q.ready_ms is not None]
    elif layout == "packed":
        nbytes = model.profile.grad_bytes
        before = [Op("compute", "pack", model.copy_ms(2 * nbytes)), Op("collective", "flat buffer", nbytes=nbytes),
                  Op("compute", "unpack", model.copy_ms(2 * nbytes))]
        memory = _replicated(model, _bytes(model.profile.params))  # the packed gradients, transient
    elif layout == "zero1":  # each rank owns whole tensors (``assign_owners``) of the gradients that come
        synced = [q.bytes for q in model.profile.params if q.ready_ms is not None]
        loads = [0] * model.world_size
        for size, owner in zip(synced, assign_owners(synced, model.world_size)):
            loads[owner] += size
        nbytes, segment = sum(loads), max(loads)  # every segment padded to the largest: equal reduce-scatter chunks
        buffer = model.world_size * segment
        before = [Op("compute", "pack gradients", model.copy_ms(nbytes + buffer)),
                  Op("collective", "reduce-scatter gradients", nbytes=buffer, op="reduce_scatter"),
                  Op("compute", "unpack own gradients", model.copy_ms(2 * segment))]
        fraction = segment / nbytes if nbytes else 1.0
        # parameters, gradients, the own segment's AdamW state, the buffer
        memory = 2 * _bytes(model.profile.params) + ADAM_MOMENTS * segment + buffer
        after = [Op("compute", "pack own parameters", model.copy_ms(2 * segment)),
                 Op("collective", "all-gather parameters", nbytes=buffer, op="all_gather"),
                 Op("compute", "unpack parameters", model.copy_ms(buffer + nbytes))]
    else:
        raise ValueError(f"no shared schedule syncs a {layout!r} layout after backward: name a hook in the entry's "
                         "`projection` (docs/projection.md, Adding a model)")
    return _staged_schedule(model, [], presence_flags=True, before=before, optimizer_fraction=fraction,
                            after=after, memory_bytes=memory)


def _padded(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n``: an element-wise shard of equal size on every rank."""
    return -(-numel // n) * n


def _copy(model: StepModel, label: str, nbytes: float, waits: str = "") -> Op:
    """A sharded engine's copy of ``nbytes`` (read and written) on the compute stream; none on one rank."""
    return Op("compute", label, model.copy_ms(2 * nbytes) if model.world_size > 1 else 0.0, waits=waits)


def _shard_op(label: str, nbytes: int, op: str) -> Op:
    """A ``reduce_scatter`` or ``all_gather`` of ``nbytes`` labelled ``<label> [reduce-scatter]`` (or all-gather)."""
    return Op("collective", f"{label} [{op.replace('_', '-')}]", nbytes=nbytes, op=op)


def _zero2(model: StepModel, bucket_size_mb: Optional[float]) -> StepResult:
    """ZeRO-2: each bucket reduce-scattered as it fills, the optimizer on the shard, then per bucket an all-gather."""
    params, n = model.profile.params, model.world_size
    buckets = _engine_buckets(params, bucket_size_mb)
    launch, after = [], []
    padded_total = 0
    for k, bucket in enumerate(buckets):
        label = _bucket_label(model, bucket, k)
        nbytes, numel = _bytes(params, bucket), sum(params[i].numel for i in bucket)
        padded = round(_padded(numel, n) * nbytes / numel) if numel else 0  # the flat buffer, in n equal shards
        padded_total += padded
        launch.append([_copy(model, f"pack bucket {k}", nbytes), _shard_op(label, padded, "reduce_scatter")])
        after += [_copy(model, f"pack own shard {k}", padded / n), _shard_op(label, padded, "all_gather"),
                  _copy(model, f"unpack bucket {k}", nbytes)]
    grad_bytes = _bytes(params)
    fraction = padded_total / n / grad_bytes if grad_bytes else 1.0
    # parameters; gradient, AdamW and gathered-parameter shards; the gradients of a filling bucket (the largest, twice)
    largest = max((_bytes(params, b) for b in buckets), default=0)
    memory = grad_bytes + (2 + ADAM_MOMENTS) * (padded_total // n) + 2 * largest
    return _staged_schedule(model, _ready(model, buckets), launch=launch, presence_flags=_missing(model),
                            optimizer_fraction=fraction, after=after, memory_bytes=memory)


_BLOCK = re.compile(r"^(.*?\b[A-Za-z_]\w*\.\d+)\.")
"""A parameter name's block prefix: up to the first ``<name>.<index>`` (``blocks.3`` of ``blocks.3.attn.w``)."""


def transformer_blocks(params: Sequence[ParamTiming]) -> tuple[list[int], dict[str, list[int]]]:
    """``(root, blocks)``: indices of the parameters outside any block, and of each block's by its name
    (``<name>.<index>.``, what a ``ModuleList`` holds: ``fully_shard``'s units), in forward order.

    >>> transformer_blocks([ParamTiming("tok_emb.weight", 4, 16, None), ParamTiming("blocks.0.w", 4, 16, 2.0),
    ...                     ParamTiming("blocks.1.w", 4, 16, 1.0), ParamTiming("lm_head.weight", 4, 16, 0.5)])
    ([0, 3], {'blocks.0': [1], 'blocks.1': [2]})
    """
    root: list[int] = []
    blocks: dict[str, list[int]] = {}
    for i, q in enumerate(params):
        match = _BLOCK.match(q.name)
        if match is None:
            root.append(i)
        else:
            blocks.setdefault(match.group(1), []).append(i)
    return root, blocks


def _largest_shard_bytes(params: Sequence[ParamTiming], indices: Sequence[int], shard_ranks: int) -> int:
    """Bytes of rank 0's shard, the largest, of the parameters at ``indices``, each split on dim 0 over
    ``shard_ranks`` ranks as ``fully_shard`` splits it (``memory_model.dim0_shard_numel``)."""
    total = 0
    for i in indices:
        q = params[i]
        shape = q.shape if q.shape is not None else (q.numel,)  # a tensor without a recorded shape: split flat
        element = q.bytes / q.numel if q.numel else 4.0
        total += round(dim0_shard_numel(shape, shard_ranks) * element)
    return total


class _ShardedUnit(NamedTuple):
    """One ``fully_shard`` unit of FSDP2's schedule: a transformer block, or the root group (every other parameter)."""

    label: str  # its name (``blocks.3``, ``root``): its collectives' label
    shard_bytes: int  # rank 0's shard (the largest) of its parameters; as much again of gradients, of each moment
    collective_bytes: int  # its all-gather's and reduce-scatter's size: every rank's shard padded to rank 0's
    unsharded_bytes: int  # its parameters whole, copied out of its all-gather; its gradients, into its reduce-scatter

    @classmethod
    def of(cls, params: Sequence[ParamTiming], label: str, indices: Sequence[int], shard_ranks: int) -> _ShardedUnit:
        """The unit of the parameters at ``indices``, each split on dim 0 over ``shard_ranks`` ranks."""
        shard_bytes = _largest_shard_bytes(params, indices, shard_ranks)
        return cls(label=label, shard_bytes=shard_bytes, collective_bytes=shard_ranks * shard_bytes,
                   unsharded_bytes=_bytes(params, indices))


class _BackwardTimes(NamedTuple):
    """Where FSDP2's units fall in the profile's backward (ms of its backward work)."""

    head_ms: float  # when the root's gradients that come before any block's are ready (the head's, the final norm's)
    block_ready_ms: list[float]  # when each block's last gradient is ready, blocks in forward order
    backward_order: list[int]  # the blocks in the order backward finishes them
    block_backward_ms: dict[int, float]  # each block's own work: from the previous unit's ready time to its own
    embedding_ms: float  # after the last block's: the rest of the root's (the embedding's)


def _backward_times(profile: ComputeProfile, root: Sequence[int], blocks: Sequence[Sequence[int]]) -> _BackwardTimes:
    """The ``_BackwardTimes`` of ``root`` and ``blocks`` (parameter indices); a block with no gradient at all is taken
    to finish with backward."""
    params, span = profile.params, profile.backward_span_ms
    block_ready = [max((params[i].ready_ms for i in block if params[i].ready_ms is not None), default=span)
                   for block in blocks]
    order = sorted(range(len(blocks)), key=lambda k: block_ready[k])
    first_block_ready = min(block_ready) if block_ready else None
    head_ms = max((params[i].ready_ms for i in root if params[i].ready_ms is not None
                   and (first_block_ready is None or params[i].ready_ms <= first_block_ready)), default=0.0)
    previous_ready = head_ms
    block_backward_ms = {}
    for k in order:
        block_backward_ms[k] = max(0.0, block_ready[k] - previous_ready)
        previous_ready = block_ready[k]
    return _BackwardTimes(head_ms=head_ms, block_ready_ms=block_ready, backward_order=order,
                          block_backward_ms=block_backward_ms, embedding_ms=max(0.0, span - previous_ready))


def _at(sequence: Sequence[int], position: int) -> Optional[int]:
    """``sequence[position]``, or ``None`` past its end (the next block, if there is one)."""
    return sequence[position] if position < len(sequence) else None


class _FSDP2Schedule:
    """FSDP2's operations, unit by unit: the forward's all-gathers one block ahead; in backward a bucket per block, in
    backward order (after the head's), each launch copying its gradients in, reduce-scattering them and prefetching
    the next blocks; the root's last. Blocks go by their index in forward order (``None``: past the last, nothing),
    the root group may be ``None`` (no parameter outside the blocks)."""

    def __init__(self, model: StepModel, blocks: Sequence[_ShardedUnit], root: Optional[_ShardedUnit],
                 times: _BackwardTimes) -> None:
        self.model = model
        self.blocks = blocks
        self.root = root
        self.times = times

    def all_gather(self, k: Optional[int]) -> list[Op]:
        """Block ``k``'s parameters all-gathered (ahead of their use: the stream runs it while compute goes on)."""
        return [] if k is None else [_shard_op(self.blocks[k].label, self.blocks[k].collective_bytes, "all_gather")]

    def copy_out(self, k: Optional[int]) -> list[Op]:
        """Block ``k``'s parameters copied out of its all-gather, once that has ended."""
        if k is None:
            return []
        block = self.blocks[k]
        return [_copy(self.model, f"copy out block {k}", block.unsharded_bytes, f"{block.label} [all-gather]")]

    def forward(self) -> list[Op]:
        """Each part as long as its backward times forward/backward: the root gathered and block 0 prefetched, the
        embedding; each block computing while the next is gathered; the head; the first block of backward gathered."""
        profile, times, root = self.model.profile, self.times, self.root
        scale = profile.forward_ms / profile.backward_span_ms if profile.backward_span_ms > 0 else 0.0
        forward_order = range(len(self.blocks))
        ops = []
        if root is not None:
            ops.append(_shard_op(root.label, root.collective_bytes, "all_gather"))
        ops += self.all_gather(_at(forward_order, 0))
        if root is not None:
            ops.append(_copy(self.model, "copy out root", root.unsharded_bytes, f"{root.label} [all-gather]"))
        ops.append(Op("compute", "forward (embedding)", scale * times.embedding_ms, copy=False))
        for k in forward_order:
            ops += [*self.all_gather(_at(forward_order, k + 1)), *self.copy_out(k),
                    Op("compute", f"forward block {k}", scale * times.block_backward_ms[k], copy=False)]
        ops.append(Op("compute", "forward (head)", scale * times.head_ms, copy=False))
        return ops + self.all_gather(_at(times.backward_order, 0))

    def backward(self) -> tuple[list[Optional[float]], list[list[Op]]]:
        """``(ready, launch)`` of ``_staged_schedule``: a bucket per unit, launched when its gradients are ready: the
        head's (only the next blocks gathered and copied out), each block's (its gradients copied in and
        reduce-scattered, the block after next gathered, the next one copied out), the root's after backward."""
        order, root = self.times.backward_order, self.root
        ready: list[Optional[float]] = [self.times.head_ms, *(self.times.block_ready_ms[k] for k in order)]
        launch = [[*self.all_gather(_at(order, 1)), *self.copy_out(_at(order, 0))]]
        for position, k in enumerate(order):
            block = self.blocks[k]
            launch.append([_copy(self.model, f"copy in gradients {k}", block.unsharded_bytes), *self.reduce(block),
                           *self.all_gather(_at(order, position + 2)), *self.copy_out(_at(order, position + 1))])
        if root is not None:  # launched after the embedding's backward
            ready.append(None)
            launch.append([_copy(self.model, "copy in root gradients", root.unsharded_bytes), *self.reduce(root)])
        return ready, launch

    def reduce(self, unit: _ShardedUnit) -> list[Op]:
        """``unit``'s gradients reduce-scattered, each rank left with its shard."""
        return [_shard_op(unit.label, unit.collective_bytes, "reduce_scatter")]


class _HSDPSchedule(_FSDP2Schedule):
    """FSDP2's schedule within a shard group, each unit's gradient shard then all-reduced across the replicas."""

    def reduce(self, unit: _ShardedUnit) -> list[Op]:
        """``unit``'s gradients reduce-scattered in the shard group, then its shard all-reduced over the replicas
        (queued behind the reduce-scatter: torch issues it once that has ended)."""
        return [*super().reduce(unit), Op("collective", f"{unit.label} [all-reduce]", nbytes=unit.shard_bytes)]


@dataclass(frozen=True)
class HybridComm:
    """hsdp's collectives on a world of ``replicas x shard_size`` ranks (a ``CommCost``): every reduce-scatter and
    all-gather within a shard group on ``shard``, every all-reduce across the replicas on ``replicate``."""

    shard: CommCost
    """Cost of the reduce-scatters and all-gathers within one shard group."""
    replicate: CommCost
    """Cost of the all-reduces across the replicas (one rank per shard group)."""
    shard_size: int
    """Ranks per shard group."""
    replicas: int
    """Shard groups; ``shard_size * replicas`` is the world."""

    def collective_s(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds for one ``kind`` of ``nbytes`` on the whole world ``n``: all-reduces on ``replicate``
        over ``replicas`` ranks, the rest on ``shard`` over ``shard_size``; ``n`` must be that world."""
        assert n == self.shard_size * self.replicas, "hsdp's groups are of its own world"
        if kind == "all_reduce":
            return self.replicate.collective_s(kind, nbytes, self.replicas)
        return self.shard.collective_s(kind, nbytes, self.shard_size)


def simulate_hsdp(model: StepModel, bucket_size_mb: Optional[float] = None,
                  shard_size: Optional[int] = None) -> StepResult:
    """hsdp: FSDP2's schedule within each shard group of ``shard_size`` ranks (None: the GPUs of one node; every rank
    on one node or a one-level fabric), each unit's reduce-scatter followed by its shard's all-reduce across the
    replicas, one rank per node on its share of the node's NICs. One replica is fsdp2."""
    comm, n = model.comm, model.world_size
    if shard_size is None:
        shard_size = comm.shard_group_size(n) if isinstance(comm, Fabric) else n
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 or n % shard_size:
        raise ValueError(f"hsdp: shard_size {shard_size!r} does not divide the world of {n} ranks; set it to a "
                         f"divisor (e.g. the GPUs of one node) in `study.engine_settings`, or null")
    if shard_size == n:
        return _fully_sharded(model, n, _FSDP2Schedule)
    across = comm.across_nodes() if isinstance(comm, Fabric) else comm
    groups = HybridComm(shard=comm, replicate=across, shard_size=shard_size, replicas=n // shard_size)
    return _fully_sharded(replace(model, comm=groups), shard_size, _HSDPSchedule)


def _fully_sharded(model: StepModel, shard_ranks: int, schedule_type: type[_FSDP2Schedule]) -> StepResult:
    """A step of ``fully_shard`` per transformer block and on the root, each unit sharded over ``shard_ranks``
    ranks, on ``schedule_type``'s schedule."""
    profile = model.profile
    root_indices, block_indices = transformer_blocks(profile.params)
    blocks = [_ShardedUnit.of(profile.params, name, indices, shard_ranks) for name, indices in block_indices.items()]
    root = _ShardedUnit.of(profile.params, "root", root_indices, shard_ranks)  # all 0 bytes without root parameters
    times = _backward_times(profile, root_indices, list(block_indices.values()))
    schedule = schedule_type(model, blocks, root if root_indices else None, times)
    ready, launch = schedule.backward()
    shard_bytes = root.shard_bytes + sum(block.shard_bytes for block in blocks)  # rank 0's: the optimizer steps it
    total_bytes = _bytes(profile.params)
    unsharded = fully_sharded_unsharded_peak(root.unsharded_bytes, [block.unsharded_bytes for block in blocks])
    # the shards of the parameters, the gradients and AdamW's moments, and what is unsharded at the peak
    memory_bytes = (2 + ADAM_MOMENTS) * shard_bytes + unsharded.parameters + unsharded.gradients
    return _staged_schedule(model, ready, launch=launch, presence_flags=False,
                            optimizer_fraction=shard_bytes / total_bytes if total_bytes else 1.0,
                            forward=schedule.forward(), memory_bytes=memory_bytes)


def powersgd_plan(shapes: Sequence[Optional[tuple[int, ...]]], rank: int,
                  min_compression_rate: float) -> list[Optional[tuple[int, int, int]]]:
    """Per gradient of a bucket, ``(rows, cols, k)`` if the PowerSGD engine compresses it, else ``None``: the
    engine's ``plan_bucket`` rule without torch (tested to agree).

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
        compresses = (rows + cols) * k * min_compression_rate < rows * cols  # P and Q smaller than M by the rate
        plan.append((rows, cols, k) if compresses else None)
    return plan


Matrix = tuple[int, int, int]
"""A compressed gradient of ``powersgd_plan``: ``(rows, cols, k)``."""


def _powersgd_p_ms(model: StepModel, matrices: Sequence[Matrix], g: float, f: float, p_numel: int) -> float:
    """The compute before P's all-reduce, each kernel a ``kernel_ms`` roofline: ``M = G + E``, Q orthogonalised,
    ``P = M Q``, then ``P /= n``; ``g``, ``f``: bytes per element of the gradients and of PowerSGD's matrices."""
    kernel = model.kernel_ms
    return sum(kernel(0, rows * cols * (g + f)) + kernel(0, 3 * rows * cols * f)  # M = G (copy); M += E
               + kernel(2 * cols * k * k, 2 * cols * k * f)  # orthogonalise Q
               + kernel(2 * rows * cols * k, (rows * cols + cols * k + rows * k) * f)  # P = M Q
               for rows, cols, k in matrices) + kernel(0, 2 * p_numel * f)  # P /= n


def _powersgd_q_ms(model: StepModel, matrices: Sequence[Matrix], uncompressed: int, g: float, f: float,
                   q_numel: int) -> float:
    """The compute between P's all-reduce and Q's: the ``uncompressed`` elements written back into the bucket, P
    orthogonalised, ``Q = M^T P``, then ``Q /= n``."""
    kernel = model.kernel_ms
    return model.copy_ms(2 * uncompressed * g) + sum(
        kernel(2 * rows * k * k, 2 * rows * k * f)  # orthogonalise P
        + kernel(2 * rows * cols * k, (rows * cols + rows * k + cols * k) * f)  # Q = M^T P
        for rows, cols, k in matrices) + kernel(0, 2 * q_numel * f)  # Q /= n


def _powersgd_decompress_ms(model: StepModel, matrices: Sequence[Matrix], g: float, f: float) -> float:
    """After Q's all-reduce: ``P Q^T`` into the bucket, and the error ``E = M - P Q^T`` kept."""
    kernel = model.kernel_ms
    return sum(kernel(2 * rows * cols * k, (rows * k + cols * k + rows * cols) * f)  # P Q^T
               + kernel(0, rows * cols * (f + g))  # into the bucket
               + kernel(0, rows * cols * (2 * f + g))  # E = M - P Q^T
               for rows, cols, k in matrices)


def simulate_bucketed_powersgd(model: StepModel, bucket_size_mb: Optional[float] = 25.0, rank: int = 4,
                               min_compression_rate: float = 2.0) -> StepResult:
    """PowerSGD's steady state on the bucketed engine's buckets, each kernel a ``kernel_ms`` roofline."""
    p = model.profile
    if not p.has_shapes:
        missing = next(q.name for q in p.params if q.shape is None)
        raise ValueError(
            f"PowerSGD's model needs every parameter's shape (which gradients are matrices), but the compute profile "
            f"has none for {missing!r}: use a modelled profile (`compute.source: flops`) or one the CommTimer "
            "recorded with shapes, or leave it out of `study.strategies`"
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
    buffer_bytes = sum(_bytes(params, bucket) for bucket, copied in zip(buckets, buffered) if copied)
    for b, bucket in enumerate(buckets):
        label = _bucket_label(model, bucket, b)
        nbytes = _bytes(params, bucket)
        tensors_numel = sum(params[i].numel for i in bucket)
        numel = tensors_numel + sentinel_numel(b, len(buckets))  # the last bucket's missing-gradient sentinel
        g = nbytes / tensors_numel if tensors_numel else 4.0  # a bucket holds one dtype
        f = max(g, 4.0)  # M, E, P and Q: fp32 at least
        pack = Op("compute", f"pack bucket {b}", model.copy_ms(2 * nbytes) if buffered[b] else 0.0)
        matrices = [m for m in powersgd_plan([params[i].shape for i in bucket], rank, min_compression_rate) if m]
        if not matrices:  # nothing worth compressing: averaged exactly, as bucketed
            launch.append([pack, Op("collective", label, nbytes=round(numel * g))])
            finish.append([])
            continue
        buffer_bytes += sum(4 * (rows * cols + cols * k) for rows, cols, k in matrices)  # E and Q, fp32
        uncompressed = numel - sum(rows * cols for rows, cols, _ in matrices)
        p_numel = sum(rows * k for rows, _, k in matrices)
        q_numel = sum(cols * k for _, cols, k in matrices)
        steps = [pack]
        if uncompressed:
            steps += [Op("compute", f"gather uncompressed {b}", model.copy_ms(4 * uncompressed * g)),
                      Op("collective", f"{label} [uncompressed]", nbytes=round(uncompressed * g))]
        steps += [Op("compute", f"PowerSGD P {b}", _powersgd_p_ms(model, matrices, g, f, p_numel)),
                  Op("collective", f"{label} [PowerSGD P]", nbytes=round(p_numel * f))]
        launch.append(steps)
        q_ms = _powersgd_q_ms(model, matrices, uncompressed, g, f, q_numel)
        finish.append([Op("compute", f"PowerSGD Q {b}", q_ms),
                       Op("collective", f"{label} [PowerSGD Q]", nbytes=round(q_numel * f)),
                       Op("compute", f"PowerSGD decompress {b}", _powersgd_decompress_ms(model, matrices, g, f))])
    return _staged_schedule(model, _ready(model, buckets), launch=launch, finish=finish,
                            presence_flags=_missing(model), memory_bytes=_replicated(model, buffer_bytes))


# ---- the simulated strategies: the catalogue's entries with a ``projection`` ---------------------------------


def simulate_from_facts(entry: catalogue.Entry, model: StepModel, bucket_size_mb: Optional[float]) -> StepResult:
    """The step of an entry with ``projection="schedule"``, from its facts (docs/projection.md, Adding a model)."""
    if entry.memory == "fully_sharded":  # every unit sharded over the world
        return _fully_sharded(model, model.world_size, _FSDP2Schedule)
    if not entry.overlaps_backward:
        return _after_backward(model, entry.memory)
    if entry.memory == "full_buckets":  # torch DDP's own buckets and copies
        return _torch_ddp(model)
    size = bucket_size_mb if entry.has_bucket_size else 1 / MiB  # no cap: a 1-byte one, one bucket per gradient
    return _zero2(model, size) if entry.sharded else _bucketed(model, size, bf16=False)


def simulated_names(modelled: bool = True) -> list[str]:
    """The catalogue entries with a ``projection`` (``modelled=False``: without one, "not projected"), in order."""
    return [name for name, entry in catalogue.STRATEGIES.items() if (entry.projection is not None) == modelled]


def simulated_by(model: str | Callable[..., StepResult]) -> list[str]:
    """The catalogue names, in order, simulated by the hook ``model``, or from their facts with ``memory == model``
    (e.g. ``"zero1"``, ``"full_buckets"``)."""
    if callable(model):
        return [name for name, entry in catalogue.STRATEGIES.items()
                if entry.projection == f"{model.__module__}:{model.__name__}"]
    return [name for name, entry in catalogue.STRATEGIES.items()
            if entry.projection == catalogue.SCHEDULE and entry.memory == model]


def simulator(name: str) -> Callable[..., StepResult]:
    """The ``simulate(model, bucket_size_mb, **settings)`` of strategy ``name``."""
    if name not in catalogue.STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(simulated_names())}")
    entry = catalogue.STRATEGIES[name]
    if entry.projection is None:
        raise ValueError(
            f"strategy {name!r} has no model in the projection: add a simulate function, or set `projection=\"schedule"
            "\"` in its catalogue entry where its facts describe its schedule (docs/projection.md, Adding a model), or "
            f"leave it out (projected: {', '.join(simulated_names())})")
    if entry.projection == catalogue.SCHEDULE:
        return functools.partial(simulate_from_facts, entry)
    return catalogue.load(entry.projection)


def model_settings(name: str, given: Iterable[str] = ()) -> dict[str, Any]:
    """The engine settings the model of ``name`` takes, with their defaults; refuses a ``given`` one it does not."""
    parameters = list(inspect.signature(simulator(name)).parameters.values())[2:]
    valid = {q.name: q.default for q in parameters
             if q.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    for setting in given:
        if setting not in valid:
            raise ValueError(f"the projection of {name!r} models no setting {setting!r}; its settings are: "
                             f"{', '.join(valid) or 'none'} (an engine setting that does not change the step time is "
                             "not modelled)")
    return valid


def simulate(name: str, model: StepModel, bucket_size_mb: Optional[float] = None, **settings: Any) -> StepResult:
    """Simulate one step of strategy ``name`` (``settings``: e.g. ``rank=4``, where its model has them)."""
    model_settings(name, settings)
    if catalogue.get(name).has_bucket_size:
        bucket_size_mb = catalogue.DEFAULT_BUCKET_SIZE_MB if bucket_size_mb is None else bucket_size_mb
    elif bucket_size_mb is not None:
        raise ValueError(f"strategy {name!r} takes no bucket size, got bucket_size_mb={bucket_size_mb!r}")
    result = simulator(name)(model, bucket_size_mb, **settings)
    # an entry may reuse another's model; one without buckets may be simulated with a 1-byte cap
    return replace(result, strategy=name, bucket_size_mb=bucket_size_mb, settings=dict(settings))
