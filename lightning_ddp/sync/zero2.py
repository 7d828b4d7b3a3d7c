"""ZeRO stage 2: ``ZeRO2DDP`` reduces each gradient bucket, laid out by owner, to its owners *during backward*; every
rank keeps only what it owns. Schedule, memory and traffic: ``docs/algorithms.md``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.assignment import assign_owners
from lightning_ddp.sync.base import check_number, pack, views
from lightning_ddp.sync.bucketed import BucketEngine
from lightning_ddp.sync.memory_model import ZERO2_BUCKETS_IN_FLIGHT
from lightning_ddp.sync.sharding import COLLECTIVE_IMPLS, CollectiveImpl, check_choice, resolve_collectives

MAX_PADDING = 0.125
"""``native``: one reduce-scatter only if padding the owners' segments adds at most this fraction of elements."""


@dataclass
class BucketPlan:
    """How one bucket travels: its parameters grouped by owner, each segment's place in the send buffer."""

    indices: list[int]  # the bucket's parameters (indices into the engine's params), in bucket order
    segments: list[list[int]]  # segments[r]: the parameters rank r owns, in bucket order
    numels: list[int]  # elements of each segment's gradients (its flags follow them)
    offsets: list[int]  # where segment r starts in the send buffer
    total: int  # elements of the send buffer
    scatter: bool  # one reduce_scatter (segments padded to equal width) rather than one reduce per owner
    shard_offset: int = 0  # where this rank's segment lands in its shard of the bucket's dtype


def plan_bucket(indices: list[int], numels: list[int], owners: list[int], world_size: int, native: bool) -> BucketPlan:
    """The layout of one bucket (pure: identical on every rank).

    Two ranks, a bucket of parameters 0 (6 elements, rank 1's), 1 (4, rank 0's) and 2 (2, rank 0's): segment 0 is
    4 + 2 elements and 2 flags (8), segment 1 is 6 and 1 flag (7). Padded to 8 each they waste 1 of 15 (< 1/8), so
    ``native`` sends one reduce-scatter of 16:

    >>> plan = plan_bucket([0, 1, 2], [6, 4, 2], [1, 0, 0], 2, native=True)
    >>> plan.segments, plan.offsets, plan.total, plan.scatter
    ([[1, 2], [0]], [0, 8], 16, True)
    >>> plan_bucket([0], [6], [1], 2, native=True).scatter  # one owner: padding would double the bytes
    False
    """
    segments: list[list[int]] = [[] for _ in range(world_size)]
    for i in indices:
        segments[owners[i]].append(i)
    sizes_numel = [sum(numels[i] for i in seg) for seg in segments]
    sizes = [n + len(seg) for n, seg in zip(sizes_numel, segments)]
    width = max(sizes)
    scatter = native and world_size * width <= (1 + MAX_PADDING) * sum(sizes)
    ends = list(accumulate([width] * world_size if scatter else sizes, initial=0))  # segments padded if scatter
    return BucketPlan(list(indices), segments, sizes_numel, ends[:-1], ends[-1], scatter)


@dataclass
class _InFlight:
    plan: BucketPlan
    buffer: torch.Tensor
    received: torch.Tensor | None  # reduce_scatter's output (this rank's segment)
    pending: list[dist.Work] = field(default_factory=list)


class ZeRO2DDP(BucketEngine):
    """Reduce gradient buckets to their owners during backward; keep only the owned gradients (ZeRO-2).

    Train it with ``ShardedOptimizer(..., schedule="reduce_in_backward", placement=engine.owner_of)``.

    Args:
        bucket_size_mb: Bucket cap in MiB; ``None`` for one bucket per dtype; ``"auto"`` to predict it.
        collectives: ``auto`` (``per_owner`` on gloo, ``native`` otherwise), ``native`` or ``per_owner``.
        buckets_in_flight: How many launched buckets (send buffers) may wait at once.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | Literal["auto"] | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        collectives: CollectiveImpl = "auto",
        buckets_in_flight: int = ZERO2_BUCKETS_IN_FLIGHT,
    ) -> None:
        self.check_settings(collectives=collectives, buckets_in_flight=buckets_in_flight)
        super().__init__(module, bucket_size_mb, process_group)
        self.buckets_in_flight = buckets_in_flight
        self.collectives = resolve_collectives(collectives, self.device, process_group)
        """``native`` or ``per_owner`` (``auto`` resolved for the parameters' device)."""
        world, rank = self.world_size, self.comm.rank
        nbytes = [p.nbytes for p in self.params]
        self.owners = assign_owners(nbytes, world)
        """The owner rank of each trainable parameter (``params`` order)."""
        self._owner_by_id = {id(p): owner for p, owner in zip(self.params, self.owners)}
        numels = [p.numel() for p in self.params]
        native = self.collectives == "native"
        self._plans = [plan_bucket(indices, numels, self.owners, world, native) for indices in self.bucket_indices]
        # The shard's layout: per dtype, this rank's owned gradients, bucket by bucket (each segment contiguous).
        self._shard_numel: dict[torch.dtype, int] = {}
        for plan in self._plans:
            dtype = self.params[plan.indices[0]].dtype
            plan.shard_offset = self._shard_numel.get(dtype, 0)
            self._shard_numel[dtype] = plan.shard_offset + plan.numels[rank]
        self._reset_step()

    @staticmethod
    def check_settings(collectives: str = "auto", buckets_in_flight: int = ZERO2_BUCKETS_IN_FLIGHT) -> None:
        """Refuse bad settings when the config is read (the strategy calls this)."""
        check_choice("collectives", collectives, COLLECTIVE_IMPLS)
        check_number("buckets_in_flight", buckets_in_flight, 1, "set e.g. `buckets_in_flight: 2`")

    # -- ownership ---------------------------------------------------------------------------------------

    def owner_of(self, param: torch.Tensor) -> int | None:
        """The rank ``param``'s gradient is reduced to (``None`` for a parameter this engine does not sync)."""
        return self._owner_by_id.get(id(param))

    @property
    def shard_bytes(self) -> int:
        """Bytes of gradients this rank keeps after backward (b·Ψ_r): its owned gradients, all dtypes."""
        return sum(n * dtype.itemsize for dtype, n in self._shard_numel.items())

    @property
    def shards(self) -> dict[torch.dtype, torch.Tensor]:
        """This step's shards (dtype -> flat owned gradients), as far as allocated; empty between steps."""
        return dict(self._shards)

    # -- the step ------------------------------------------------------------------------------------------

    def _reset_step(self) -> None:
        super()._reset_step()
        self._in_flight: deque[_InFlight] = deque()
        self._flags: list[tuple[list[int], torch.Tensor]] = []  # (owned indices, their summed presence flags)
        # Dropped here: the owned .grad views keep this step's shards alive until zero_grad drops them.
        self._shards: dict[torch.dtype, torch.Tensor] = {}

    def _launch(self, b: int) -> None:
        plan = self._plans[b]
        dtype = self.params[plan.indices[0]].dtype
        label = f"bucket {b} ({len(plan.indices)} tensors)"
        with self.comm.span("pack"):
            # Padding (reduce_scatter) must be zeros; a per-owner buffer is written in full.
            buffer = (torch.zeros if plan.scatter else torch.empty)(plan.total, dtype=dtype, device=self.device)
            for r, segment in enumerate(plan.segments):  # each segment: its gradients, then their presence flags
                start, numel = plan.offsets[r], plan.numels[r]
                params = [self.params[i] for i in segment]
                pack([p.grad for p in params], params, buffer[start : start + numel])
                for k, param in enumerate(params):
                    buffer[start + numel + k] = float(param.grad is not None)
                    param.grad = None  # the buffer holds it now: free it
        flight = _InFlight(plan, buffer, None)
        if plan.scatter:
            width = plan.total // self.world_size
            flight.received = torch.empty(width, dtype=dtype, device=self.device)
            flight.pending.append(self.comm.reduce_scatter(flight.received, buffer, label))
        else:
            for r, segment in enumerate(plan.segments):
                if segment:
                    part = buffer[plan.offsets[r] : plan.offsets[r] + plan.numels[r] + len(segment)]
                    flight.pending.append(self.comm.reduce(part, r, f"{label} to rank {r}"))
        self._in_flight.append(flight)
        while len(self._in_flight) > self.buckets_in_flight:  # bound the send buffers held at once
            # Waiting here holds up backward (the host on gloo, the compute stream on NCCL): exposed communication,
            # as the waits in finish_gradient_synchronization are (spans are merged, so nesting there is harmless).
            with self.comm.span("exposed"):
                self._complete(self._in_flight.popleft())

    def _complete(self, flight: _InFlight) -> None:
        for pending in flight.pending:
            self.comm.wait(pending)
        plan, rank = flight.plan, self.comm.rank
        segment = plan.segments[rank]
        if not segment:
            return  # the buffer goes with `flight`
        mine = flight.received if flight.received is not None else flight.buffer[plan.offsets[rank]:]
        numel = plan.numels[rank]
        dtype = self.params[segment[0]].dtype
        with self.comm.span("pack"):
            shard = self._shards.get(dtype)
            if shard is None:  # every element is written by the step's buckets before anyone reads it
                shard = self._shards[dtype] = torch.empty(self._shard_numel[dtype], dtype=dtype, device=self.device)
            torch.div(mine[:numel], self.world_size, out=shard[plan.shard_offset : plan.shard_offset + numel])
            self._flags.append((segment, mine[numel : numel + len(segment)].clone()))
            owned = [self.params[i] for i in segment]
            for param, grad in zip(owned, views(shard[plan.shard_offset :], owned)):
                param.grad = grad

    def _synchronize(self) -> None:
        self._launch_rest()
        while self._in_flight:
            self._complete(self._in_flight.popleft())
        if self._flags:
            counts = torch.cat([flags for _, flags in self._flags]).tolist()  # one host sync per step
            owned = [i for segment, _ in self._flags for i in segment]
            for i, count in zip(owned, counts):
                if count == 0:  # no rank had a gradient: .grad = None, as in one process (the optimizer skips it)
                    self.params[i].grad = None
        self._reset_step()
