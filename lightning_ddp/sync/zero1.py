"""ZeRO stage 1: shard the optimizer state over the ranks; each rank updates only the parameters it owns.

Recipe (``ShardedOptimizer``):

1. At construction, give every parameter one owner rank: greedy by bytes, largest first, onto the least-loaded
   rank (``assign_owners``; a pure function, identical on every rank). Build the wrapped optimizer
   (``optimizer_cls``, e.g. AdamW) over the owned parameters only, one inner group per outer group, so only
   the owner ever allocates optimizer state for a parameter.
2. ``step()``: run the closure if given; with ``schedule="reduce_scatter"``, reduce-scatter the gradients so
   each owner holds the average of its own parameters' gradients; copy the outer groups' hyperparameters into
   the inner groups (an LR scheduler writes the outer ones); step the wrapped optimizer (its own shard); then
   send every updated parameter from its owner to the other ranks, so all ranks hold identical weights again.
3. ``add_param_group`` (also later, e.g. when unfreezing layers) assigns the new parameters onto the current
   loads; parameters already placed never move (their state stays where it is).

Two schedules (``schedule=``):

``allreduce_broadcast``
    A DDP engine (``NaiveDDP`` ... ``BucketedDDP``) has already all-reduced every gradient in backward; each
    owner steps its shard and broadcasts its updated parameters.
``reduce_scatter``
    The ZeRO-1 schedule proper. The model's container must *not* all-reduce (``DeferredGradSync``): in
    ``step()``, a reduce-scatter leaves each owner the average of its shard's gradients, the owner steps, and
    an all-gather of the parameters makes the ranks identical. Reduce-scatter plus all-gather is exactly the
    decomposition of a ring all-reduce, so this moves the volume of plain DDP.

Memory and communication per rank and step. Ψ parameters (4 bytes each, fp32), T parameter tensors, N ranks,
Ψ_r the parameters rank r owns (≈ Ψ/N), K bytes of optimizer state per parameter. For fp32 AdamW, K = 8
(``exp_avg`` and ``exp_avg_sq``) plus a 4-byte ``step`` tensor per parameter tensor; the ZeRO paper's K = 12 is
mixed precision, where an fp32 master copy of the fp16 weights joins the optimizer state. "Sent" counts
bandwidth-optimal algorithms (ring all-reduce 2(N-1)/N·M, reduce-scatter and all-gather (N-1)/N·M each,
broadcast or reduce of M: (N-1)·M summed over ranks, (N-1)/N·M per rank on average over owners):

=========================  ===========  ===========  ==================  ===================================
                           parameters   gradients    optimizer state     sent per rank per step
=========================  ===========  ===========  ==================  ===================================
DDP (all-reduce)           4Ψ           4Ψ           8Ψ + 4T             2(N-1)/N · 4Ψ
ZeRO-1 allreduce_broadcast 4Ψ           4Ψ           8Ψ_r + 4T_r         2(N-1)/N · 4Ψ + (N-1)/N · 4Ψ = 1.5×
ZeRO-1 reduce_scatter      4Ψ           4Ψ           8Ψ_r + 4T_r         (N-1)/N · 4Ψ + (N-1)/N · 4Ψ = 1×
=========================  ===========  ===========  ==================  ===================================

The xl preset (Ψ = 1,998,235,200, T = 435) on N = 2: parameters 7.44 GiB, gradients 7.44 GiB, AdamW state
14.89 GiB unsharded and 7.44 GiB sharded; per rank 29.8 GiB -> 22.3 GiB. Only the optimizer state shrinks
(ZeRO-2 would also shard gradients, ZeRO-3 parameters). Transient buffers during ``step()``: the packed
gradients (4Ψ, ``reduce_scatter``) and the packed parameters (4Ψ), the size of ``FlatDDP``'s buffer.

What runs on which backend (``collectives=``):

- ``native`` (the default on NCCL): ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` over one flat
  buffer per dtype, each rank's segment padded to the largest segment S (sent: (N-1)·4S each, S ≥ Ψ/N; the
  greedy balance keeps the padding small).
- ``per_owner`` (the default on gloo): for each owner r in turn, ``reduce`` of r's gradient segment to r, and
  ``broadcast`` of r's parameter segment from r: 2N calls, no padding, the same bytes in aggregate. Gloo
  implements ``reduce_scatter_tensor`` as an all-reduce followed by taking a chunk (pytorch#118911), and its
  ``all_gather_into_tensor`` was 3-4x slower than N broadcasts in our measurement (2 ranks on one host, 64 MiB:
  reduce-scatter 125 ms vs per-owner reduce 80 ms vs all-reduce 80 ms; all-gather 110 ms vs broadcasts 30 ms);
  older torch versions' gloo has no reduce-scatter at all.

Invariants: every rank issues the same collectives in the same order. The layout of a step depends only on
the ownership, on ``requires_grad`` and, for ``reduce_scatter``, on one tiny all-reduce of "which parameters
have a gradient here" (as in ``base``): a parameter that has a gradient on no rank keeps ``.grad = None`` and
is skipped by its owner's optimizer, exactly as in torch; one with a gradient on some ranks only is averaged
with zeros from the others. With ``allreduce_broadcast`` the gradients arrive already synchronised, so gradient
presence agrees.
All parameters of the optimizer must live on one device.

Checkpoints: ``state_dict()`` is a collective (every rank must call it; Lightning's ``dump_checkpoint`` does)
and returns the *consolidated* state on every rank, on CPU, in exactly the format ``optimizer_cls`` would
produce for all parameters. A checkpoint therefore resumes under any world size, and under plain DDP with an
unsharded optimizer. ``load_state_dict`` takes that full state on every rank (Lightning loads the checkpoint
file on every rank) and keeps only the owned entries. Cost: each rank briefly holds the whole state in host
memory (8Ψ bytes for AdamW) while the checkpoint is written.

Caveats for ``reduce_scatter``: before ``step()`` the gradients are local (not averaged), so anything reading
them earlier sees one rank's gradient: gradient clipping (the strategy refuses it), gradient-norm logging, fp16
``GradScaler``'s inf check. ``allreduce_broadcast`` has none of these limits.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_ddp.sync.base import DataParallel, launch_recorded, wait_recorded
from lightning_ddp.sync.record import Collective, StepClock, SyncRecord

Schedule = Literal["allreduce_broadcast", "reduce_scatter"]
CollectiveImpl = Literal["auto", "native", "per_owner"]
SCHEDULES: tuple[str, ...] = ("allreduce_broadcast", "reduce_scatter")
COLLECTIVE_IMPLS: tuple[str, ...] = ("auto", "native", "per_owner")

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older versions lack the new ones.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_GROUP_KEYS_NOT_HYPERPARAMETERS = ("params", "param_names")


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not supported; choose 'allreduce_broadcast' (a DDP engine all-reduces the "
            "gradients, owners broadcast their updated parameters) or 'reduce_scatter' (ZeRO-1: reduce-scatter "
            "gradients, all-gather parameters)."
        )


def check_collective_impl(collectives: str) -> None:
    if collectives not in COLLECTIVE_IMPLS:
        raise ValueError(
            f"collectives={collectives!r} is not supported; choose 'auto' (per_owner on gloo, native otherwise), "
            "'native' (reduce_scatter_tensor / all_gather_into_tensor) or 'per_owner' (reduce / broadcast per owner)."
        )


def assign_owners(nbytes: Sequence[int], world_size: int, loads: Sequence[int] | None = None) -> list[int]:
    """The owner rank of each parameter: greedy, largest first, onto the least-loaded rank.

    Parameters are visited by decreasing size, ties by index; each goes to the rank with the fewest bytes so
    far, ties to the lower rank. Pure and deterministic, so every rank computes the same assignment. ``loads``
    are bytes the ranks already own (for parameters added later with ``add_param_group``).

    Sizes 12, 8, 4, 4 go to r0; r1; r1 (loads 12 : 8); r0 (12 : 12, a tie: the lower rank):

    >>> assign_owners([4, 12, 8, 4], world_size=2)
    [1, 0, 1, 0]

    Continuing from loads 16 : 12, the first 4 goes to r1, the second to r0 (16 : 16, a tie):

    >>> assign_owners([4, 4], world_size=2, loads=[16, 12])
    [1, 0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    current = list(loads) if loads is not None else [0] * world_size
    if len(current) != world_size:
        raise ValueError(f"loads has {len(current)} entries, expected one per rank ({world_size})")
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(world_size), key=lambda r: (current[r], r))
        owners[index] = rank
        current[rank] += nbytes[index]
    return owners


@dataclass
class _Pending:
    work: dist.Work
    collective: Collective


class ShardedOptimizer(Optimizer):
    """Wrap any ``torch.optim.Optimizer`` class so each rank keeps optimizer state only for the parameters it owns.

    ``param_groups`` are the full, outer groups (every parameter, every hyperparameter of ``optimizer_cls``); an
    LR scheduler may change them and ``step()`` copies them into the wrapped optimizer ``optim``, which holds
    the owned parameters only. ``state`` is ``optim.state``: the shard's state.

    Args:
        params: Parameters or parameter groups, as for any optimizer.
        optimizer_cls: The optimizer class to shard, e.g. ``torch.optim.AdamW``.
        schedule: ``allreduce_broadcast`` (gradients already all-reduced by a DDP engine) or ``reduce_scatter``
            (ZeRO-1: gradients are local; use ``DeferredGradSync`` as the container). See the module docstring.
        collectives: ``auto``, ``native`` or ``per_owner``: how reduce-scatter and all-gather run (module docstring).
        process_group: The group to shard over (default: the world).
        **kwargs: Defaults of ``optimizer_cls`` (``lr``, ``betas``, ``weight_decay``, ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        *,
        schedule: Schedule = "allreduce_broadcast",
        collectives: CollectiveImpl = "auto",
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        check_schedule(schedule)
        check_collective_impl(collectives)
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(
                f"optimizer_cls must be a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW; got {optimizer_cls!r}"
            )
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError(
                "optimizer_cls is already a ShardedOptimizer; pass the optimizer class to shard, e.g. torch.optim.AdamW"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedOptimizer needs a process group: call torch.distributed.init_process_group() first "
                "(or train through the `zero1_ddp` strategy, which does it for you)."
            )
        self.optimizer_cls = optimizer_cls
        self.schedule = schedule
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if collectives == "auto":
            collectives = "per_owner" if dist.get_backend(process_group) == "gloo" else "native"
        self.collectives = collectives
        # Filled by add_param_group, which Optimizer.__init__ calls once per group.
        self._params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(param) -> position in self._params (the state_dict index)
        self._owners: list[int] = []
        self._loads = [0] * self.world_size
        self.optim: Optimizer | None = None
        self._recorder: DataParallel | None = None
        self._own_record = SyncRecord()
        self._own_clock: StepClock | None = None
        super().__init__(params, dict(kwargs))
        self._check_one_device()
        # Assign everything at once (better balanced than group by group), then build the inner optimizer.
        self._owners = assign_owners([_nbytes(p) for p in self._params], self.world_size)
        for param, owner in zip(self._params, self._owners):
            self._loads[owner] += _nbytes(param)
        self.optim = optimizer_cls([self._inner_group(group) for group in self.param_groups], **kwargs)
        # The outer groups show every hyperparameter the wrapped class defines, so that state_dict() is exactly
        # what optimizer_cls would produce and schedulers find e.g. `betas`; defaults too, for add_param_group.
        self.defaults = dict(self.optim.defaults)
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in inner.items():
                if key not in _GROUP_KEYS_NOT_HYPERPARAMETERS:
                    outer.setdefault(key, value)
        self.state = self.optim.state  # the shard's state; Lightning's _optimizer_to_device walks it

    @classmethod
    def from_optimizer(
        cls,
        optimizer: Optimizer,
        *,
        schedule: Schedule = "allreduce_broadcast",
        collectives: CollectiveImpl = "auto",
        process_group: dist.ProcessGroup | None = None,
    ) -> ShardedOptimizer:
        """Shard an optimizer that has not stepped yet: same class, same defaults, *the same* group dicts.

        Sharing the group dicts means an LR scheduler built on ``optimizer`` already writes into this
        optimizer's groups; re-point it anyway (``scheduler.optimizer = sharded``), as the strategy does.
        """
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("the optimizer is already a ShardedOptimizer")
        if any(optimizer.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__} already has state; shard it before its first step (the strategy wraps "
                "the optimizers right after configure_optimizers)."
            )
        # Pass on the defaults the class accepts (AdamW's `defaults` also holds `decoupled_weight_decay`, which
        # its constructor does not take); the groups themselves carry every hyperparameter anyway.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        kwargs = {k: v for k, v in optimizer.defaults.items() if (takes_any or k in accepted) and k != "params"}
        return cls(
            optimizer.param_groups,
            type(optimizer),
            schedule=schedule,
            collectives=collectives,
            process_group=process_group,
            **kwargs,
        )

    # -- ownership --------------------------------------------------------------------------------------

    def owner(self, param: torch.Tensor) -> int:
        """The rank (within the process group) that keeps ``param``'s optimizer state and updates it."""
        return self._owners[self._index[id(param)]]

    @property
    def shard_bytes(self) -> list[int]:
        """Bytes of parameters each rank owns (the balance ``assign_owners`` achieved)."""
        return list(self._loads)

    def _inner_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """The wrapped optimizer's group for outer ``group``: its hyperparameters, only the owned parameters."""
        inner = {k: v for k, v in group.items() if k not in _GROUP_KEYS_NOT_HYPERPARAMETERS}
        inner["params"] = [p for p in group["params"] if self._owners[self._index[id(p)]] == self.rank]
        return inner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its new parameters go to the least-loaded ranks (parameters already placed never move)."""
        super().add_param_group(param_group)  # validates, fills defaults, rejects parameters already present
        group = self.param_groups[-1]
        for param in group["params"]:
            self._index[id(param)] = len(self._params)
            self._params.append(param)
        if self.optim is None:
            return  # inside __init__: everything is assigned at once after the last group
        self._check_one_device()
        new = group["params"]
        owners = assign_owners([_nbytes(p) for p in new], self.world_size, loads=self._loads)
        for param, owner in zip(new, owners):
            self._owners.append(owner)
            self._loads[owner] += _nbytes(param)
        self.optim.add_param_group(self._inner_group(group))

    # -- recording --------------------------------------------------------------------------------------

    def attach_record(self, container: DataParallel) -> None:
        """Append this optimizer's collectives to ``container.record`` (on ``container.clock``), step by step.

        The engine opens a fresh record per optimizer step and the ``CommTimer`` reads it after the step, so the
        optimizer's broadcasts, reduces and gathers are accounted with the engine's all-reduces. Unattached, the
        optimizer opens its own record in every ``step()`` (``.record``).
        """
        self._recorder = container

    @property
    def record(self) -> SyncRecord:
        """Where this step's collectives are recorded: the attached engine's record, else our own."""
        return self._recorder.record if self._recorder is not None else self._own_record

    @property
    def clock(self) -> StepClock:
        if self._recorder is not None:
            return self._recorder.clock
        if self._own_clock is None:
            self._own_clock = StepClock(self._device())
        return self._own_clock

    def _launch(self, op: str, label: str, nbytes: int, start: Callable[[], dist.Work]) -> _Pending:
        """Issue an async collective and record it (the engines' ``launch_recorded``)."""
        return _Pending(*launch_recorded(self.record, self.clock, op, label, nbytes, start))

    def _wait(self, pending: _Pending) -> None:
        wait_recorded(self.clock, pending.work, pending.collective)

    # -- the step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure``; synchronise gradients (``reduce_scatter``); update the owned shard; share the weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self.optim is not None
        if self._recorder is None:  # standalone: one record per step, like an engine's
            self.clock.start()
            self._own_record = SyncRecord()
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        if self.schedule == "reduce_scatter":
            self._reduce_scatter_gradients(trainable)
        # An LR scheduler (or the user) writes the outer groups; the inner optimizer reads its own.
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key not in _GROUP_KEYS_NOT_HYPERPARAMETERS:
                    inner[key] = value
        self.optim.step(**kwargs)
        self._share_parameters(trainable)
        return loss

    def _device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    def _check_one_device(self) -> None:
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(
                "ShardedOptimizer needs all parameters on one device (its flat buffers do), got "
                f"{sorted(map(str, devices))}; move the model to its device before building the optimizer."
            )

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.process_group, group_rank) if self.process_group is not None else group_rank

    def _layout(self, indices: list[int]) -> list[tuple[torch.dtype, list[list[int]]]]:
        """``indices`` split by dtype (in order of first appearance), then by owner: segments[r] in index order."""
        by_dtype: dict[torch.dtype, list[list[int]]] = {}
        for i in indices:
            segments = by_dtype.setdefault(self._params[i].dtype, [[] for _ in range(self.world_size)])
            segments[self._owners[i]].append(i)
        return list(by_dtype.items())

    def _pack(self, tensors: list[torch.Tensor | None], params: list[torch.Tensor], out: torch.Tensor) -> None:
        """Copy ``tensors`` (one per parameter in ``params``; zeros for ``None``) flat into ``out``."""
        start = self.clock.mark()
        offset = 0
        for tensor, param in zip(tensors, params):
            chunk = out[offset : offset + param.numel()]
            if tensor is None:
                chunk.zero_()
            else:
                chunk.copy_(tensor.reshape(-1))
            offset += param.numel()
        self.record.pack.append((start, self.clock.mark()))

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self._device())

    def _reduce_scatter_gradients(self, trainable: list[int]) -> None:
        """Leave each owner the average over ranks of its parameters' gradients (others' .grad stay local)."""
        if not trainable:
            return
        clock, group = self.clock, self.process_group
        phase_start = clock.mark()
        has_grad = [self._params[i].grad is not None for i in trainable]
        flags = torch.tensor(has_grad, dtype=torch.int32, device=self._device())
        nbytes = flags.numel() * flags.element_size()
        self._wait(
            self._launch("all_reduce", "gradient presence flags", nbytes,
                         lambda: dist.all_reduce(flags, group=group, async_op=True))
        )
        # A parameter no rank has a gradient for keeps .grad = None everywhere: its owner skips it, as torch would.
        present = [i for i, count in zip(trainable, flags.tolist()) if count > 0]
        for dtype, segments in self._layout(present):
            params = [[self._params[i] for i in segment] for segment in segments]  # [rank] -> its parameters
            sizes = [sum(p.numel() for p in owned) for owned in params]
            if self.collectives == "native":
                width = max(sizes)  # every segment padded to the largest: reduce-scatter needs equal chunks
                send = torch.zeros(self.world_size * width, dtype=dtype, device=self._device())
                for r, owned in enumerate(params):
                    self._pack([p.grad for p in owned], owned, send[r * width : r * width + sizes[r]])
                recv = self._empty(width, dtype)
                label = f"gradients {dtype} ({len(present)} tensors)"
                nbytes = send.numel() * send.element_size()
                self._wait(
                    self._launch("reduce_scatter", label, nbytes,
                                 lambda: _reduce_scatter_tensor(recv, send, group=group, async_op=True))
                )
                mine = recv[: sizes[self.rank]]
            else:
                launched = []  # (buffer, pending) per owner, in rank order
                for r, owned in enumerate(params):
                    if sizes[r] == 0:
                        continue
                    buffer = self._empty(sizes[r], dtype)
                    self._pack([p.grad for p in owned], owned, buffer)
                    label = f"gradients of rank {r} ({len(owned)} tensors)"
                    launched.append((r, buffer, self._reduce(buffer, r, label)))
                mine = None
                for r, buffer, pending in launched:
                    self._wait(pending)
                    if r == self.rank:
                        mine = buffer  # only the owner's copy holds the sum
            if mine is not None:
                self._unpack_gradients(mine, params[self.rank])
        self.record.exposed.append((phase_start, clock.mark()))

    def _unpack_gradients(self, summed: torch.Tensor, params: list[torch.Tensor]) -> None:
        start = self.clock.mark()
        summed.div_(self.world_size)  # sum -> average (gloo has no AVG)
        offset = 0
        for param in params:
            value = summed[offset : offset + param.numel()].view_as(param)
            if param.grad is None:  # no gradient here, but some other rank had one
                param.grad = value.clone()  # a clone: a view would keep the whole buffer alive
            else:
                param.grad.copy_(value)
            offset += param.numel()
        self.record.pack.append((start, self.clock.mark()))

    def _share_parameters(self, trainable: list[int]) -> None:
        """Send every trainable parameter from its owner to the other ranks (broadcasts, or one all-gather)."""
        clock, group = self.clock, self.process_group
        phase_start = clock.mark()
        for dtype, segments in self._layout(trainable):
            params = [[self._params[i] for i in segment] for segment in segments]  # [rank] -> its parameters
            sizes = [sum(p.numel() for p in owned) for owned in params]
            mine = params[self.rank]
            received: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (flat values, their parameters)
            if self.collectives == "native":
                width = max(sizes)
                send = torch.zeros(width, dtype=dtype, device=self._device())
                self._pack([p.detach() for p in mine], mine, send)
                gathered = self._empty(self.world_size * width, dtype)
                label = f"parameters {dtype} ({len(trainable)} tensors)"
                nbytes = send.numel() * send.element_size()
                self._wait(
                    self._launch("all_gather", label, nbytes,
                                 lambda: _all_gather_tensor(gathered, send, group=group, async_op=True))
                )
                received = [(gathered[r * width : r * width + sizes[r]], owned) for r, owned in enumerate(params)]
            else:
                launched = []
                for r, owned in enumerate(params):
                    if sizes[r] == 0:
                        continue
                    buffer = self._empty(sizes[r], dtype)
                    if r == self.rank:
                        self._pack([p.detach() for p in owned], owned, buffer)
                    label = f"parameters of rank {r} ({len(owned)} tensors)"
                    launched.append((buffer, owned, self._broadcast(buffer, r, label)))
                for buffer, owned, pending in launched:
                    self._wait(pending)
                    received.append((buffer, owned))
            start = clock.mark()
            for flat, owned in received:
                if owned is mine:
                    continue  # already up to date: this rank computed them
                offset = 0
                for param in owned:
                    param.copy_(flat[offset : offset + param.numel()].view_as(param))
                    offset += param.numel()
            self.record.pack.append((start, clock.mark()))
        self.record.exposed.append((phase_start, clock.mark()))

    def _reduce(self, buffer: torch.Tensor, owner: int, label: str) -> _Pending:
        """Async SUM-reduce of ``buffer`` to group rank ``owner``, recorded."""
        dst, group = self._global_rank(owner), self.process_group
        nbytes = buffer.numel() * buffer.element_size()
        return self._launch("reduce", label, nbytes, lambda: dist.reduce(buffer, dst=dst, group=group, async_op=True))

    def _broadcast(self, buffer: torch.Tensor, owner: int, label: str) -> _Pending:
        """Async broadcast of ``buffer`` from group rank ``owner``, recorded."""
        src, group = self._global_rank(owner), self.process_group
        nbytes = buffer.numel() * buffer.element_size()
        return self._launch(
            "broadcast", label, nbytes, lambda: dist.broadcast(buffer, src=src, group=group, async_op=True)
        )

    # -- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full (consolidated) state, on CPU, as ``optimizer_cls`` would return it for all parameters.

        A collective: every rank must call it, and every rank gets the whole state. One ``all_gather_object``
        of the owned entries' shapes, then one ``broadcast`` per state tensor from its owner.
        """
        assert self.optim is not None
        local: dict[int, dict[str, tuple]] = {}
        for param, entry in self.optim.state.items():
            local[self._index[id(param)]] = {
                key: ("tensor", tuple(value.shape), value.dtype) if torch.is_tensor(value) else ("value", value)
                for key, value in entry.items()
            }
        described: list[dict[int, dict[str, tuple]]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(described, local, group=self.process_group)
        device = self._device()  # NCCL needs CUDA tensors, even for Adam's CPU `step` counters
        state: dict[int, dict[str, Any]] = {}
        for r in range(self.world_size):
            for index in sorted(described[r]):
                entry: dict[str, Any] = {}
                for key, (kind, *rest) in described[r][index].items():
                    if kind == "value":
                        entry[key] = rest[0]
                        continue
                    shape, dtype = rest
                    if r == self.rank:
                        buffer = self.optim.state[self._params[index]][key].detach().to(device, copy=True)
                    else:
                        buffer = torch.empty(shape, dtype=dtype, device=device)
                    dist.broadcast(buffer, src=self._global_rank(r), group=self.process_group)
                    entry[key] = buffer.cpu()
                state[index] = entry
        param_groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [self._index[id(p)] for p in group["params"]]
            param_groups.append(packed)
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` or an unsharded ``optimizer_cls``); keep the owned entries.

        Not a collective. The hyperparameters of every group come from ``state_dict`` as in torch.
        """
        assert self.optim is not None
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state has {len(saved_groups)} parameter groups but this optimizer has {len(self.param_groups)}; "
                "load a checkpoint of the same model and configure_optimizers."
            )
        saved_index: dict[int, Any] = {}  # id(param) -> its index in state_dict
        for number, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"parameter group {number} has {len(group['params'])} parameters but the state has "
                    f"{len(saved['params'])} for it; load a checkpoint of the same model and configure_optimizers."
                )
            for index, param in zip(saved["params"], group["params"]):
                saved_index[id(param)] = index
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        inner_state: dict[int, Any] = {}
        inner_groups = []
        position = 0
        for group, inner in zip(self.param_groups, self.optim.param_groups):
            positions = []
            for param in inner["params"]:
                index = saved_index[id(param)]
                if index in state_dict["state"]:
                    inner_state[position] = state_dict["state"][index]
                positions.append(position)
                position += 1
            packed = {k: v for k, v in group.items() if k not in _GROUP_KEYS_NOT_HYPERPARAMETERS}
            packed["params"] = positions
            inner_groups.append(packed)
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state = self.optim.state  # torch's load_state_dict replaced the dict


class DeferredGradSync(DataParallel):
    """A container that leaves gradients local; ``ShardedOptimizer(schedule="reduce_scatter")`` syncs them in step().

    Like every engine it broadcasts rank 0's parameters and buffers, supports ``no_sync()`` and opens a
    ``SyncRecord`` per step (the optimizer records its reduce-scatter and all-gather there), but
    ``finish_gradient_synchronization()`` communicates nothing.
    """

    def _synchronize(self) -> None:
        pass  # the ShardedOptimizer reduce-scatters the gradients inside step()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
