"""``ShardedOptimizer``: any ``torch.optim.Optimizer`` class, each rank keeping state only for what it owns.

The recipe, the schedules and the memory and traffic figures: ``docs/algorithms.md`` (ZeRO-1, ZeRO-2).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Literal, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_ddp.sync.comm import Communicator, RecordsThroughComm, backend_for
from lightning_ddp.sync.assignment import assign_owners
from lightning_ddp.sync.sharding import checkpoint
from lightning_ddp.sync.sharding.checkpoint import GROUP_KEYS_NOT_HYPERPARAMETERS
from lightning_ddp.sync.sharding.clipping import ClipRequest, clip_owned_gradients
from lightning_ddp.sync.sharding.collectives import reduce_scatter_gradients, share_parameters

Schedule = Literal["allreduce_broadcast", "reduce_scatter"]
OptimizerSchedule = Literal["allreduce_broadcast", "reduce_scatter", "reduce_in_backward"]
CollectiveImpl = Literal["auto", "native", "per_owner"]
SCHEDULES: tuple[str, ...] = ("allreduce_broadcast", "reduce_scatter")
"""ZeRO-1's schedules (what the ``zero1_ddp`` strategy offers)."""
OPTIMIZER_SCHEDULES: tuple[str, ...] = (*SCHEDULES, "reduce_in_backward")
"""What ``ShardedOptimizer`` accepts: ZeRO-1's, and ZeRO-2's ``reduce_in_backward``."""
Placement = Callable[[torch.Tensor], Optional[int]]
COLLECTIVE_IMPLS: tuple[str, ...] = ("auto", "native", "per_owner")

__all__ = ["COLLECTIVE_IMPLS", "OPTIMIZER_SCHEDULES", "SCHEDULES", "CollectiveImpl", "OptimizerSchedule", "Placement",
           "Schedule", "ShardedOptimizer", "check_collective_impl", "check_schedule", "resolve_collectives"]


def check_schedule(schedule: str, accepted: tuple[str, ...] = SCHEDULES) -> None:
    """Refuse a schedule outside ``accepted`` (ZeRO-1's by default; ``OPTIMIZER_SCHEDULES`` for the optimizer)."""
    if schedule not in accepted:
        extra = (" or 'reduce_in_backward' (ZeRO-2: the zero2 engine reduced the gradients to their owners in "
                 "backward)") if "reduce_in_backward" in accepted else ""
        raise ValueError(
            f"schedule={schedule!r} is not supported; choose 'allreduce_broadcast' (a DDP engine all-reduces the "
            "gradients, owners broadcast their updated parameters) or 'reduce_scatter' (ZeRO-1: reduce-scatter "
            f"gradients, all-gather parameters){extra}."
        )


def check_collective_impl(collectives: str) -> None:
    if collectives not in COLLECTIVE_IMPLS:
        raise ValueError(
            f"collectives={collectives!r} is not supported; choose 'auto' (per_owner on gloo, native otherwise), "
            "'native' (reduce_scatter_tensor / all_gather_into_tensor) or 'per_owner' (reduce / broadcast per owner)."
        )


def resolve_collectives(
    collectives: str, device: torch.device | str, group: dist.ProcessGroup | None = None
) -> str:
    """``collectives`` with ``auto`` resolved for ``device``: ``per_owner`` where gloo moves it, else ``native``."""
    check_collective_impl(collectives)
    if collectives != "auto":
        return collectives
    return "per_owner" if backend_for(device, group) == "gloo" else "native"


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
        check_schedule(schedule, OPTIMIZER_SCHEDULES)
        if schedule == "reduce_in_backward" and placement is None:
            raise ValueError(
                "schedule='reduce_in_backward' steps the gradients ZeRO2DDP reduced to their owners, so the owners "
                "must be the engine's: pass placement=engine.owner_of."
            )
        check_collective_impl(collectives)
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
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedOptimizer needs a process group: call torch.distributed.init_process_group() first "
                "(or train through the `zero1_ddp` strategy, which does it for you)."
            )
        self.optimizer_cls = optimizer_cls
        self.schedule = schedule
        self.process_group = process_group
        self.comm = Communicator(process_group)
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        # Filled by add_param_group, which Optimizer.__init__ calls once per group.
        self._params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(param) -> position in self._params (the state_dict index)
        self._owners: list[int] = []
        self._loads = [0] * self.world_size
        self._placement = placement
        self._clip: ClipRequest | None = None  # requested for the next step() (clip_grad_norm_, clip_grad_value_)
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
            for key, value in inner.items():
                if key not in GROUP_KEYS_NOT_HYPERPARAMETERS:
                    outer.setdefault(key, value)
        self.state = self.optim.state  # the shard's state; Lightning's _optimizer_to_device walks it

    @classmethod
    def from_optimizer(
        cls,
        optimizer: Optimizer,
        *,
        schedule: OptimizerSchedule = "allreduce_broadcast",
        collectives: CollectiveImpl = "auto",
        process_group: dist.ProcessGroup | None = None,
        placement: Placement | None = None,
    ) -> ShardedOptimizer:
        """Shard an optimizer that has not stepped yet: same class, same defaults, *the same* group dicts.

        Re-point an LR scheduler built on ``optimizer`` anyway (``scheduler.optimizer = sharded``).
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
            placement=placement,
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
        inner = {k: v for k, v in group.items() if k not in GROUP_KEYS_NOT_HYPERPARAMETERS}
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
                reduce_scatter_gradients(
                    self.comm, self._params, self._owners, trainable, self.collectives, self.device
                )
        self.last_grad_norm = None
        if self._clip is not None:  # now every owned gradient is the average over the ranks
            request, self._clip = self._clip, None
            owned = [p.grad for i, p in enumerate(self._params)
                     if p.grad is not None and p.requires_grad and self._owners[i] == self.rank]
            with self.comm.span("exposed"):
                self.last_grad_norm = clip_owned_gradients(self.comm, owned, request, self.device)
        # An LR scheduler (or the user) writes the outer groups; the inner optimizer reads its own.
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key not in GROUP_KEYS_NOT_HYPERPARAMETERS:
                    inner[key] = value
        self.optim.step(**kwargs)
        with self.comm.span("exposed"):
            share_parameters(self.comm, self._params, self._owners, trainable, self.collectives, self.device)
        return loss

    # -- clipping (lightning_ddp.sync.sharding.clipping) ---------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip by the global 2-norm at the next ``step()`` (a collective there); the norm is in ``last_grad_norm``."""
        if norm_type != 2.0:
            raise ValueError(
                f"ShardedOptimizer clips by the 2-norm only, got norm_type={norm_type!r}; drop norm_type."
            )
        self._clip = ClipRequest("norm", float(max_norm))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the gradients to ``[-clip_value, clip_value]`` at the next ``step()`` (each owner its own)."""
        self._clip = ClipRequest("value", float(clip_value))

    def _check_one_device(self) -> None:
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(
                "ShardedOptimizer needs all parameters on one device (its flat buffers do), got "
                f"{sorted(map(str, devices))}; move the model to its device before building the optimizer."
            )

    # -- checkpoints (lightning_ddp.sync.sharding.checkpoint) ----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full state on CPU, as ``optimizer_cls`` would return it; a collective, every rank gets it all."""
        return checkpoint.consolidated_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` or an unsharded ``optimizer_cls``); keep the owned entries."""
        checkpoint.load_shard(self, state_dict)
        self.state = self.optim.state  # torch's load_state_dict replaced the dict
