"""The base every engine shares: it broadcasts rank 0's parameters and buffers when it wraps the model, and
``finish_gradient_synchronization()`` leaves the average over ranks in every ``.grad`` (the invariants:
``docs/algorithms.md``); with the flat buffers (``pack``, ``unpack_*``) and ``agree_on_gradients``.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.comm import Communicator, RecordsThroughComm, profiler_range, require_process_group
from lightning_ddp.sync.ranges import GRAD_SYNC


class GradSyncEngine(RecordsThroughComm, nn.Module):
    """Base of the engines: the model wrapped for data parallelism (torch DDP's role), at ``.module``.

    Subclasses implement ``_synchronize()`` and, to communicate during backward, ``_on_grad_ready(index)``.
    """

    uses_grad_hooks: bool = False  # whether to call _on_grad_ready from post-accumulate-grad hooks

    state_summary: str = ""
    """What ``engine_state_dict`` holds, in words, for the warning of a resumed run; empty without state."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        require_process_group(type(self).__name__, "the Lightning strategy")
        self.module = module
        self.process_group = process_group
        self.comm = Communicator(process_group)
        self.world_size = self.comm.world_size
        self.require_backward_grad_sync = True
        # module.parameters() yields a tied tensor once; frozen parameters are never communicated.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        verify_same_parameters(module, self.comm, self.device)
        broadcast_module_states(module, process_group)
        hooked = enumerate(self.params) if self.uses_grad_hooks else ()
        hook = self._grad_hook
        self._hook_handles = [param.register_post_accumulate_grad_hook(partial(hook, i)) for i, param in hooked]

    # -- the conventional interface -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for the backward passes inside (gradient-accumulation micro-batches)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def on_train_batch_start(self) -> None:
        """A micro-batch begins: forget launch state a step left unfinished (nothing launches under ``no_sync``)."""
        self._reset_step()

    def finish_gradient_synchronization(self) -> None:
        """Leave the average over ranks of every gradient in ``.grad``; call after the last backward."""
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "finish_gradient_synchronization() was called inside no_sync(); call it once per optimizer step, "
                "after the backward of the last micro-batch, outside no_sync()."
            )
        self._check_no_parameter_was_unfrozen()
        with self.comm.span("exposed"), profiler_range(GRAD_SYNC):
            self._synchronize()

    def _check_no_parameter_was_unfrozen(self) -> None:
        # The engine synchronises the parameters that were trainable when it wrapped the model. One unfrozen
        # later would silently train on each rank's local gradient, so its gradient is an error.
        late = [name for name, param in self._frozen if param.grad is not None]
        if late:
            raise RuntimeError(
                f"{', '.join(late[:3])}{' ...' if len(late) > 3 else ''} had requires_grad=False when "
                f"{type(self).__name__} wrapped the model but now have gradients, which it would not synchronise. "
                "Unfreeze parameters before wrapping (before trainer.fit), or wrap the model again."
            )

    # -- the engine's own state (checkpoints) -----------------------------------------------------------

    def engine_state_dict(self) -> dict[str, Any]:
        """What ``state_dict()`` holds besides the wrapped model's; ``{}`` without state. May differ per rank."""
        return {key: value for key, value in self.state_dict().items() if not key.startswith("module.")}

    def load_engine_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``engine_state_dict()`` of the same rank of a run with the same engine and settings.

        Raises ``ValueError`` when ``state``'s keys or shapes do not fit this engine.
        """
        expected = set(self.engine_state_dict())
        if set(state) != expected:
            raise ValueError(
                f"the engine state has {sorted(state)} but {type(self).__name__} has {sorted(expected)}; load the "
                "state of a run of the same algorithm, or none."
            )
        if state:
            self.load_state_dict(dict(state), strict=False)

    # -- for subclasses -------------------------------------------------------------------------------

    def _synchronize(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _synchronize()")

    def _on_grad_ready(self, index: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} sets uses_grad_hooks but lacks _on_grad_ready()")

    def _reset_step(self) -> None:
        """Drop per-step launch state (engines that launch during backward keep some)."""

    def _grad_hook(self, index: int, param: torch.Tensor) -> None:
        if self.require_backward_grad_sync:
            self._on_grad_ready(index)

    @property
    def device(self) -> torch.device:
        """Where the parameters (and so the gradients and communication buffers) live."""
        return self.params[0].device if self.params else torch.device("cpu")


def check_number(name: str, value: Any, minimum: float | None, fix: str, integer: bool = True) -> None:
    """Refuse an engine setting that is not an int (a number unless ``integer``) ``>= minimum``, naming ``fix``."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {value!r}; {fix}.")
    if minimum is not None and not value >= minimum:  # also NaN
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}.")


def broadcast_module_states(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's parameters and buffers to every rank, so ranks start identical whatever their seeds."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        dist.broadcast(tensor.data, src=src, group=process_group)


def describe_parameters(module: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """``(name, shape, dtype, requires_grad)`` of each of ``module.named_parameters()``, in order."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
            for name, p in module.named_parameters()]


def _first_difference(reference: list[tuple], other: list[tuple], first: int, rank: int) -> str | None:
    """How ``other`` (rank ``rank``'s ``describe_parameters``) first differs from ``reference`` (rank ``first``'s)."""
    fields = ("shape", "dtype", "requires_grad")
    for position, (mine, theirs) in enumerate(zip(reference, other)):
        if mine[0] != theirs[0]:
            return (f"parameter #{position} is {mine[0]!r} on rank {first} but {theirs[0]!r} on rank {rank} (the "
                    "parameters differ in name or order)")
        for field, a, b in zip(fields, mine[1:], theirs[1:]):
            if a != b:
                return f"parameter {mine[0]!r} has {field} {a} on rank {first} but {b} on rank {rank}"
    if len(other) > len(reference):
        return (f"rank {rank} has a parameter {other[len(reference)][0]!r} that rank {first} lacks ({len(other)} "
                f"parameters against {len(reference)})")
    if len(other) < len(reference):
        return (f"rank {rank} lacks the parameter {reference[len(other)][0]!r} that rank {first} has ({len(other)} "
                f"parameters against {len(reference)})")
    return None


def verify_same_parameters(module: nn.Module, comm: Communicator, device: torch.device) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank's ``module`` has the same parameters
    (names, shapes, dtypes, ``requires_grad``, order). One all-gather of a digest; the message names global ranks.
    """
    if comm.world_size == 1:
        return
    description = describe_parameters(module)
    digest = int.from_bytes(hashlib.sha256(repr(description).encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    digests = [torch.empty_like(mine) for _ in range(comm.world_size)]
    dist.all_gather(digests, mine, group=comm.group)
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    descriptions: list[Any] = [None] * comm.world_size
    dist.all_gather_object(descriptions, description, group=comm.group)
    difference = next(
        (found for r in range(1, comm.world_size)
         if (found := _first_difference(descriptions[0], descriptions[r], comm.global_rank(0), comm.global_rank(r)))),
        "the parameter descriptions are equal but hash differently",  # cannot happen: repr is deterministic
    )
    raise ValueError(
        f"The ranks wrap different models: {difference}. Every rank must build the same model (same architecture, "
        "dtypes and frozen parameters) before it is wrapped: look for rank-dependent code in the model's "
        "construction (or configure_model)."
    )


def views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Consecutive slices of ``flat``, each shaped as the next of ``tensors``."""
    offset = 0
    for tensor in tensors:
        yield flat[offset : offset + tensor.numel()].view_as(tensor)
        offset += tensor.numel()


def pack(tensors: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``tensors`` (one per parameter in ``params``; zeros for ``None``) flat into ``out``, in order."""
    for tensor, chunk in zip(tensors, views(out, params)):
        if tensor is None:
            chunk.zero_()
        else:
            chunk.copy_(tensor)


def unpack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (``tensor.copy_``, in order)."""
    for tensor, value in zip(tensors, views(flat, tensors)):
        tensor.copy_(value)


def unpack_gradients(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into each parameter's ``.grad`` (a clone where it was ``None``)."""
    for param, value in zip(params, views(flat, params)):
        if param.grad is None:
            param.grad = value.clone()
        elif value.data_ptr() != param.grad.data_ptr():
            param.grad.copy_(value)


def agree_on_gradients(comm: Communicator, has_grad: Sequence[bool], device: torch.device) -> list[int]:
    """For each parameter, on how many ranks it has a gradient (one small all-reduce; ``.tolist()`` blocks), so a
    parameter no rank has a gradient for can keep ``None``."""
    flags = torch.tensor(list(has_grad), dtype=torch.int32, device=device)
    comm.wait(comm.all_reduce(flags, "gradient presence flags"))
    return flags.tolist()
