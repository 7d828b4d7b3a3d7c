"""``ShardedOptimizer``: any ``torch.optim.Optimizer`` class, each rank keeping state only for what it owns.

See the package docstring (``lightning_ddp.sync.zero1``) for the recipe, the schedules and the memory and
communication figures.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Literal

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_ddp.sync.comm import Communicator, RecordsThroughComm, backend_for
from lightning_ddp.sync.zero1 import checkpoint
from lightning_ddp.sync.zero1.checkpoint import GROUP_KEYS_NOT_HYPERPARAMETERS
from lightning_ddp.sync.zero1.collectives import reduce_scatter_gradients, share_parameters
from lightning_ddp.sync.zero1.partition import assign_owners

Schedule = Literal["allreduce_broadcast", "reduce_scatter"]
CollectiveImpl = Literal["auto", "native", "per_owner"]
SCHEDULES: tuple[str, ...] = ("allreduce_broadcast", "reduce_scatter")
COLLECTIVE_IMPLS: tuple[str, ...] = ("auto", "native", "per_owner")

__all__ = ["COLLECTIVE_IMPLS", "SCHEDULES", "CollectiveImpl", "Schedule", "ShardedOptimizer", "check_collective_impl",
           "check_schedule", "resolve_collectives"]


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


def resolve_collectives(
    collectives: str, device: torch.device | str, group: dist.ProcessGroup | None = None
) -> str:
    """``collectives`` with ``auto`` resolved for tensors on ``device``: ``per_owner`` where gloo moves them,
    ``native`` otherwise. Per device, not per spec: ``cpu:gloo,cuda:nccl`` moves CUDA parameters over NCCL."""
    check_collective_impl(collectives)
    if collectives != "auto":
        return collectives
    return "per_owner" if backend_for(device, group) == "gloo" else "native"


class ShardedOptimizer(RecordsThroughComm, Optimizer):
    """Wrap any ``torch.optim.Optimizer`` class so each rank keeps optimizer state only for the parameters it owns.

    ``param_groups`` are the full, outer groups (every parameter, every hyperparameter of ``optimizer_cls``); an
    LR scheduler may change them and ``step()`` copies them into the wrapped optimizer ``optim``, which holds
    the owned parameters only. ``state`` is ``optim.state``: the shard's state.

    Args:
        params: Parameters or parameter groups, as for any optimizer.
        optimizer_cls: The optimizer class to shard, e.g. ``torch.optim.AdamW``.
        schedule: ``allreduce_broadcast`` (gradients already all-reduced by a DDP engine) or ``reduce_scatter``
            (ZeRO-1: gradients are local; use ``DeferredGradSync`` as the engine). See the package docstring.
        collectives: ``auto``, ``native`` or ``per_owner``: how reduce-scatter and all-gather run (package docstring).

    Measuring: set ``recorder`` (the strategy gives it the engine's) to record its collectives per step.
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
        self.comm = Communicator(process_group)
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        # Filled by add_param_group, which Optimizer.__init__ calls once per group.
        self._params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(param) -> position in self._params (the state_dict index)
        self._owners: list[int] = []
        self._loads = [0] * self.world_size
        self.optim: Optimizer | None = None
        super().__init__(params, dict(kwargs))
        self._check_one_device()
        self.collectives = resolve_collectives(collectives, self.device, process_group)
        """``native`` or ``per_owner`` (``auto`` resolved for the parameters' device, known only now)."""
        # Assign everything at once (better balanced than group by group), then build the inner optimizer.
        self._owners = assign_owners([p.nbytes for p in self._params], self.world_size)
        for param, owner in zip(self._params, self._owners):
            self._loads[owner] += param.nbytes
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
        new = group["params"]
        owners = assign_owners([p.nbytes for p in new], self.world_size, loads=self._loads)
        for param, owner in zip(new, owners):
            self._owners.append(owner)
            self._loads[owner] += param.nbytes
        self.optim.add_param_group(self._inner_group(group))

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
                reduce_scatter_gradients(self.comm, self._params, self._owners, trainable, self.collectives, self.device)
        # An LR scheduler (or the user) writes the outer groups; the inner optimizer reads its own.
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key not in GROUP_KEYS_NOT_HYPERPARAMETERS:
                    inner[key] = value
        self.optim.step(**kwargs)
        with self.comm.span("exposed"):
            share_parameters(self.comm, self._params, self._owners, trainable, self.collectives, self.device)
        return loss

    def _check_one_device(self) -> None:
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(
                "ShardedOptimizer needs all parameters on one device (its flat buffers do), got "
                f"{sorted(map(str, devices))}; move the model to its device before building the optimizer."
            )

    # -- checkpoints (lightning_ddp.sync.zero1.checkpoint) ----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full (consolidated) state, on CPU, as ``optimizer_cls`` would return it for all parameters.

        A collective: every rank must call it, and every rank gets the whole state.
        """
        return checkpoint.consolidated_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` or an unsharded ``optimizer_cls``); keep the owned entries."""
        checkpoint.load_shard(self, state_dict)
        self.state = self.optim.state  # torch's load_state_dict replaced the dict
