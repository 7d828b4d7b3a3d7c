"""``ShardedOptimizer`` (ZeRO-1's and ZeRO-2's): any ``torch.optim.Optimizer`` class, each rank keeping state only for
what it owns; checkpoints in ``optimizer_cls``'s own, consolidated format. Schedules, collectives (``native``,
``per_owner``), clipping, memory and traffic: ``docs/algorithms.md``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Literal, Optional, Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_ddp.sync.assignment import assign_owners
from lightning_ddp.sync.base import agree_on_gradients, pack, unpack_gradients, unpack_into
from lightning_ddp.sync.comm import (
    Communicator, RecordsThroughComm, backend_for, gather_rank_states, require_process_group,
)

Schedule = Literal["allreduce_broadcast", "reduce_scatter"]
OptimizerSchedule = Literal["allreduce_broadcast", "reduce_scatter", "reduce_in_backward"]
CollectiveImpl = Literal["auto", "native", "per_owner"]
SCHEDULES = {
    "allreduce_broadcast": "a DDP engine all-reduces the gradients, owners broadcast their updated parameters",
    "reduce_scatter": "ZeRO-1: reduce-scatter gradients, all-gather parameters",
}
"""ZeRO-1's schedules (what the ``zero1_ddp`` strategy offers), and what each does."""
OPTIMIZER_SCHEDULES = {
    **SCHEDULES, "reduce_in_backward": "ZeRO-2: the zero2 engine reduced the gradients to their owners in backward",
}
"""What ``ShardedOptimizer`` accepts: ZeRO-1's, and ZeRO-2's ``reduce_in_backward``."""
COLLECTIVE_IMPLS = {
    "auto": "per_owner on gloo, native otherwise",
    "native": "reduce_scatter_tensor / all_gather_into_tensor",
    "per_owner": "reduce / broadcast per owner",
}
Placement = Callable[[torch.Tensor], Optional[int]]
GROUP_KEYS_NOT_HYPERPARAMETERS = ("params", "param_names")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def check_choice(name: str, value: str, choices: dict[str, str]) -> None:
    """Refuse a ``value`` of setting ``name`` outside ``choices`` (choice -> what it does), listing them."""
    if value not in choices:
        listed = " or ".join(f"{choice!r} ({meaning})" for choice, meaning in choices.items())
        raise ValueError(f"{name}={value!r} is not supported; choose {listed}.")


def resolve_collectives(
    collectives: str, device: torch.device | str, group: dist.ProcessGroup | None = None
) -> str:
    """``collectives`` with ``auto`` resolved for ``device``: ``per_owner`` where gloo moves it, else ``native``."""
    check_choice("collectives", collectives, COLLECTIVE_IMPLS)
    if collectives != "auto":
        return collectives
    return "per_owner" if backend_for(device, group) == "gloo" else "native"


def layout(
    indices: Sequence[int], params: Sequence[torch.Tensor], owners: Sequence[int], world_size: int
) -> list[tuple[torch.dtype, list[list[torch.Tensor]]]]:
    """``indices`` split by dtype (in order of first appearance), then by owner: ``[(dtype, segments)]`` where
    ``segments[r]`` lists the parameters rank ``r`` owns, in index order.

    >>> p = [torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(4)]
    >>> [(dtype, [[t.numel() for t in seg] for seg in segs]) for dtype, segs in layout([0, 1, 2], p, [1, 0, 0], 2)]
    [(torch.float32, [[4], [2]]), (torch.float64, [[3], []])]
    """
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for i in indices:
        segments = by_dtype.setdefault(params[i].dtype, [[] for _ in range(world_size)])
        segments[owners[i]].append(params[i])
    return list(by_dtype.items())


def _flat_sizes(segments: list[list[torch.Tensor]]) -> list[int]:
    """Elements of each rank's segment, flat."""
    return [sum(p.numel() for p in owned) for owned in segments]


def _reduce_to_owners(
    comm: Communicator, segments: list[list[torch.Tensor]], dtype: torch.dtype, impl: str, label: str
) -> torch.Tensor | None:
    """Sum every rank's gradients of each segment onto the segment's owner, flat: one reduce-scatter (``native``,
    segments padded to the largest) or a reduce per owner (``per_owner``). Returns this rank's segment's sum (empty
    under ``native`` when it owns nothing of this dtype; ``None`` under ``per_owner``). ``label``: the collectives'."""
    world, rank = comm.world_size, comm.rank
    device = next(p.device for owned in segments for p in owned)
    sizes = _flat_sizes(segments)
    if impl == "native":
        width = max(sizes)  # every segment padded to the largest: the collective needs equal chunks
        send = torch.zeros(world * width, dtype=dtype, device=device)
        with comm.span("pack"):
            for r, owned in enumerate(segments):
                pack([p.grad for p in owned], owned, send[r * width : r * width + sizes[r]])
        received = torch.empty(width, dtype=dtype, device=device)
        comm.wait(comm.reduce_scatter(received, send, label))
        return received[: sizes[rank]]
    launched = []  # (owner, buffer, pending), in rank order
    for r, owned in enumerate(segments):
        if sizes[r] == 0:
            continue
        buffer = torch.empty(sizes[r], dtype=dtype, device=device)
        with comm.span("pack"):
            pack([p.grad for p in owned], owned, buffer)
        launched.append((r, buffer, comm.reduce(buffer, r, f"gradients of rank {r} ({len(owned)} tensors)")))
    mine = None
    for r, buffer, pending in launched:
        comm.wait(pending)
        if r == rank:  # only the owner's copy holds the sum
            mine = buffer
    return mine


def _gather_from_owners(
    comm: Communicator, segments: list[list[torch.Tensor]], dtype: torch.dtype, impl: str, label: str
) -> list[torch.Tensor | None]:
    """Send each owner's parameters of its segment to every rank, flat: one all-gather (``native``, segments padded
    to the largest) or a broadcast per owner (``per_owner``). Entry ``r`` of the result is segment ``r`` (``None``
    under ``per_owner`` where it is empty). ``label``: the collectives'."""
    world, rank = comm.world_size, comm.rank
    device = next(p.device for owned in segments for p in owned)
    sizes = _flat_sizes(segments)
    if impl == "native":
        width = max(sizes)  # every segment padded to the largest: the collective needs equal chunks
        send = torch.zeros(width, dtype=dtype, device=device)
        with comm.span("pack"):
            pack([p.detach() for p in segments[rank]], segments[rank], send[: sizes[rank]])
        gathered = torch.empty(world * width, dtype=dtype, device=device)
        comm.wait(comm.all_gather(gathered, send, label))
        return [gathered[r * width : r * width + sizes[r]] for r in range(world)]
    launched = []  # (owner, buffer, pending), in rank order
    for r, owned in enumerate(segments):
        if sizes[r] == 0:
            continue
        buffer = torch.empty(sizes[r], dtype=dtype, device=device)
        if r == rank:  # the owner sends its own; the others receive into the buffer
            with comm.span("pack"):
                pack([p.detach() for p in owned], owned, buffer)
        launched.append((r, buffer, comm.broadcast(buffer, r, f"parameters of rank {r} ({len(owned)} tensors)")))
    received: list[torch.Tensor | None] = [None] * world
    for r, buffer, pending in launched:
        comm.wait(pending)
        received[r] = buffer
    return received


def reduce_scatter_gradients(
    comm: Communicator, params: Sequence[torch.Tensor], owners: Sequence[int], trainable: list[int], impl: str
) -> None:
    """Leave each owner the average over ranks of its parameters' gradients (the others' ``.grad`` stay local);
    a parameter no rank has a gradient for keeps ``.grad = None`` everywhere."""
    if not trainable:
        return
    counts = agree_on_gradients(comm, [params[i].grad is not None for i in trainable], params[trainable[0]].device)
    present = [i for i, count in zip(trainable, counts) if count > 0]
    for dtype, segments in layout(present, params, owners, comm.world_size):
        mine = _reduce_to_owners(comm, segments, dtype, impl, f"gradients {dtype} ({len(present)} tensors)")
        if mine is not None:
            with comm.span("pack"):
                mine.div_(comm.world_size)  # sum -> average (gloo has no AVG)
                unpack_gradients(mine, segments[comm.rank])


def share_parameters(
    comm: Communicator, params: Sequence[torch.Tensor], owners: Sequence[int], trainable: list[int], impl: str
) -> None:
    """Send every trainable parameter from its owner to the other ranks (broadcasts, or one all-gather)."""
    for dtype, segments in layout(trainable, params, owners, comm.world_size):
        received = _gather_from_owners(comm, segments, dtype, impl, f"parameters {dtype} ({len(trainable)} tensors)")
        with comm.span("pack"):
            for r, (flat, owned) in enumerate(zip(received, segments)):
                if r != comm.rank and flat is not None:  # this rank's own are up to date: it computed them
                    unpack_into(flat, [p.detach() for p in owned])


def clip_owned_gradients(
    comm: Communicator, owned: Sequence[torch.Tensor], clip: tuple[str, float], device: torch.device
) -> torch.Tensor | None:
    """Apply ``clip`` (``("norm", max_norm)`` or ``("value", clip_value)``) to the owned gradients; return the global
    2-norm for ``norm`` (one scalar SUM all-reduce of the owners' squared norms; the same on every rank)."""
    algorithm, limit = clip
    if algorithm == "value":  # each owner clamps its own
        for grad in owned:
            grad.clamp_(-limit, limit)
        return None
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in owned:
        squares += torch.linalg.vector_norm(grad).double().square()
    comm.wait(comm.all_reduce(squares.reshape(1), "gradient norm"))
    norm = squares.sqrt()
    coefficient = torch.clamp(limit / (norm + CLIP_EPS), max=1.0)
    for grad in owned:
        grad.mul_(coefficient.to(grad.dtype))
    return norm


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in GROUP_KEYS_NOT_HYPERPARAMETERS}


def _clip_limit(limit: float) -> float:
    if not limit > 0:
        raise ValueError(f"the clipping limit must be > 0, got {limit!r}; set e.g. gradient_clip_val: 1.0.")
    return float(limit)


class ShardedOptimizer(RecordsThroughComm, Optimizer):
    """Wrap any ``torch.optim.Optimizer`` class so each rank keeps optimizer state only for the parameters it owns.

    ``param_groups`` are the full groups (an LR scheduler may change them; ``step()`` copies them into ``optim``,
    which holds the owned parameters only). ``state`` is the shard's state.

    Args:
        schedule: ``allreduce_broadcast``, ``reduce_scatter`` (ZeRO-1) or ``reduce_in_backward`` (ZeRO-2).
        collectives: ``auto``, ``native`` or ``per_owner``: how reduce-scatter and all-gather run.
        placement: The owner a parameter must have, or ``None`` to place it by ``assign_owners``.
        **kwargs: Defaults of ``optimizer_cls`` (``lr``, ``betas``, ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        *,
        schedule: OptimizerSchedule = "allreduce_broadcast",
        collectives: CollectiveImpl = "auto",
        process_group: dist.ProcessGroup | None = None,
        placement: Placement | None = None,
        **kwargs: Any,
    ) -> None:
        check_choice("schedule", schedule, OPTIMIZER_SCHEDULES)
        if schedule == "reduce_in_backward" and placement is None:
            raise ValueError(
                "schedule='reduce_in_backward' steps the gradients ZeRO2DDP reduced to their owners, so the owners "
                "must be the engine's: pass placement=engine.owner_of."
            )
        check_choice("collectives", collectives, COLLECTIVE_IMPLS)
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(
                "optimizer_cls must be a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW; "
                f"got {optimizer_cls!r}"
            )
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError(
                "optimizer_cls is already a ShardedOptimizer; pass the optimizer class to shard, e.g. "
                "torch.optim.AdamW"
            )
        require_process_group("ShardedOptimizer", "the `zero1_ddp` strategy")
        self.optimizer_cls = optimizer_cls
        self.schedule = schedule
        self.comm = Communicator(process_group)
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        # Filled by add_param_group, which Optimizer.__init__ calls once per group.
        self._params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(param) -> position in self._params (the state_dict index)
        self._owners: list[int] = []
        self._loads = [0] * self.world_size
        self._placement = placement
        self._clip: tuple[str, float] | None = None  # for the next step(): clip_grad_norm_, clip_grad_value_
        self.last_grad_norm: torch.Tensor | None = None
        """The global gradient norm the last ``step()`` clipped by (``clip_grad_norm_``), else ``None``."""
        self.optim: Optimizer | None = None
        super().__init__(params, dict(kwargs))
        self._check_one_device()
        self.collectives = resolve_collectives(collectives, self.device, process_group)
        """``native`` or ``per_owner`` (``auto`` resolved for the parameters' device, known only now)."""
        # Assign everything at once (better balanced than group by group), then build the inner optimizer.
        self._owners = self._place(self._params, self._loads)
        self.optim = optimizer_cls([self._inner_group(group) for group in self.param_groups], **kwargs)
        # The outer groups show every hyperparameter the wrapped class defines, so that state_dict() is exactly
        # what optimizer_cls would produce and schedulers find e.g. `betas`; defaults too, for add_param_group.
        self.defaults = dict(self.optim.defaults)
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in _hyperparameters(inner).items():
                outer.setdefault(key, value)
        self.state = self.optim.state  # the shard's state; Lightning's _optimizer_to_device walks it

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer, **settings: Any) -> ShardedOptimizer:
        """Shard an optimizer that has not stepped yet: same class, same defaults, *the same* group dicts (re-point an
        LR scheduler built on ``optimizer`` anyway). ``settings``: the constructor's keywords (``schedule``, ...)."""
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
        return cls(optimizer.param_groups, type(optimizer), **settings, **kwargs)

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
        return {**_hyperparameters(group),
                "params": [p for p in group["params"] if self._owners[self._index[id(p)]] == self.rank]}

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
        self._owners.extend(self._place(group["params"], self._loads))
        self.optim.add_param_group(self._inner_group(group))

    def _place(self, params: list[torch.Tensor], loads: list[int]) -> list[int]:
        """Owners of ``params``: ``placement``'s where it names one, the rest greedily onto ``loads`` (updated)."""
        owners: list[int | None] = [self._placement(p) if self._placement is not None else None for p in params]
        for param, owner in zip(params, owners):
            if owner is not None:
                if not 0 <= owner < self.world_size:
                    raise ValueError(
                        f"placement put a parameter on rank {owner}, outside the group of {self.world_size}"
                    )
                loads[owner] += param.nbytes
        free = [i for i, owner in enumerate(owners) if owner is None]
        for i, owner in zip(free, assign_owners([params[i].nbytes for i in free], self.world_size, loads=loads)):
            owners[i] = owner
            loads[owner] += params[i].nbytes
        return [int(owner) for owner in owners]  # type: ignore[arg-type]

    @property
    def device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    # -- the step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure``; synchronise gradients (``reduce_scatter``); update the owned shard; share the weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self.optim is not None
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        if self.schedule == "reduce_scatter":
            with self.comm.span("exposed"):
                reduce_scatter_gradients(self.comm, self._params, self._owners, trainable, self.collectives)
        self.last_grad_norm = None
        if self._clip is not None:  # now every owned gradient is the average over the ranks
            clip, self._clip = self._clip, None
            owned = [p.grad for i, p in enumerate(self._params)
                     if p.grad is not None and p.requires_grad and self._owners[i] == self.rank]
            with self.comm.span("exposed"):
                self.last_grad_norm = clip_owned_gradients(self.comm, owned, clip, self.device)
        # An LR scheduler (or the user) writes the outer groups; the inner optimizer reads its own.
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update(_hyperparameters(outer))
        self.optim.step(**kwargs)
        with self.comm.span("exposed"):
            share_parameters(self.comm, self._params, self._owners, trainable, self.collectives)
        return loss

    # -- clipping: once every owned gradient is averaged, at step() --------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip by the global 2-norm at the next ``step()`` (a collective there); the norm is in ``last_grad_norm``."""
        if norm_type != 2.0:
            raise ValueError(
                f"ShardedOptimizer clips by the 2-norm only, got norm_type={norm_type!r}; drop norm_type."
            )
        self._clip = ("norm", _clip_limit(float(max_norm)))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the gradients to ``[-clip_value, clip_value]`` at the next ``step()`` (each owner its own)."""
        self._clip = ("value", _clip_limit(float(clip_value)))

    def _check_one_device(self) -> None:
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(
                "ShardedOptimizer needs all parameters on one device (its flat buffers do), got "
                f"{sorted(map(str, devices))}; move the model to its device before building the optimizer."
            )

    # -- checkpoints: the consolidated state, in optimizer_cls's format ----------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full state on CPU, as ``optimizer_cls`` would return it; a collective, every rank gets it all."""
        assert self.optim is not None
        local = {self._index[id(param)]: dict(entry) for param, entry in self.optim.state.items()}
        # NCCL needs CUDA tensors, even for Adam's CPU `step` counters: broadcast on the parameters' device.
        owned = gather_rank_states(local, self.comm, self.device)
        assert owned is not None
        state = {index: entries[index] for entries in owned for index in sorted(entries)}
        param_groups = [{**{k: v for k, v in group.items() if k != "params"},
                         "params": [self._index[id(p)] for p in group["params"]]} for group in self.param_groups]
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` or an unsharded ``optimizer_cls``); keep the owned entries (the
        groups' hyperparameters too). Not a collective."""
        assert self.optim is not None
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state has {len(saved_groups)} parameter groups but this optimizer has "
                f"{len(self.param_groups)}; load a checkpoint of the same model and configure_optimizers."
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
        saved_state = state_dict["state"]
        owned = [saved_index[id(param)] for inner_group in self.optim.param_groups for param in inner_group["params"]]
        inner_state = {position: saved_state[index] for position, index in enumerate(owned) if index in saved_state}
        inner_groups, start = [], 0  # the inner optimizer's parameters numbered in group order
        for group, inner_group in zip(self.param_groups, self.optim.param_groups):
            end = start + len(inner_group["params"])
            inner_groups.append({**_hyperparameters(group), "params": list(range(start, end))})
            start = end
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state = self.optim.state  # torch's load_state_dict replaced the dict
