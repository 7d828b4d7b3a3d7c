"""Every private or version-dependent torch and Lightning API this package uses, behind one small module. It
imports only torch at the top (Lightning inside each helper), so the pure-PyTorch core can import it.
"""

from __future__ import annotations

import functools
import subprocess
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


# ---- torch ---------------------------------------------------------------------------------------------


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording right now (a flag read, ~0.1 us)."""
    return torch.autograd._profiler_enabled()


def cuda_driver_version() -> int:
    """The CUDA driver API version the driver supports, e.g. 12040 for CUDA 12.4."""
    return torch._C._cuda_getDriverVersion()


def tensors_of(state: Any) -> list[torch.Tensor]:
    """The tensors of ``state`` (nested lists, tuples and dicts), in the order ``map_tensors`` visits them."""
    return [leaf for leaf in pytree.tree_leaves(state) if isinstance(leaf, torch.Tensor)]


def map_tensors(function: Callable[[torch.Tensor], Any], state: Any) -> Any:
    """``state`` with every tensor replaced by ``function(tensor)``, visited in one fixed order (torch's pytree)."""
    return pytree.tree_map_only(torch.Tensor, function, state)


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older versions lack the new ones.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def fsdp2_unsharded_parameters(root: torch.nn.Module) -> dict[torch.Tensor, torch.nn.Parameter]:
    """Sharded parameter -> the unsharded parameter FSDP2 swaps in (the same object every backward, so a gradient
    hook on it fires each time) for every ``fully_shard`` group under ``root``, from FSDP2's private
    ``FSDPState._fsdp_param_group``. Gathers and frees every group once: a collective, to call on every rank."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[torch.Tensor, torch.nn.Parameter] = {}
    for module in root.modules():  # pre-order: the root first
        if not isinstance(module, FSDPModule):
            continue
        module.unshard()
        module.reshard()
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            out[fsdp_param.sharded_param] = fsdp_param._unsharded_param
    return out


# ---- torch.distributed's registry of process groups (``sync/recording_group.py`` puts its own in their place) ----


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group torch has registered in this process (the world first), stand-ins included."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    return sorted(world.pg_map, key=lambda group: group is not world.default_pg)


def world_group() -> dist.ProcessGroup | None:
    """The default process group, ``None`` before ``init_process_group``."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.default_pg


def register_stand_in(original: dist.ProcessGroup, stand_in: dist.ProcessGroup) -> None:
    """Register ``stand_in`` beside ``original`` in torch's registry and make it what the registry resolves: what
    ``group=None`` means if ``original`` is the world, and the name functional collectives and a ``DeviceMesh``
    resolve. ``original`` stays registered, so code that holds it (``dist.get_backend(group)``, ``get_rank(group)``)
    works as before. Only ``pg_names`` lists ``original`` alone: torch shuts down every group it lists, once each."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    for table in (world.pg_map, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.pg_coalesce_state):
        if original in table:
            table[stand_in] = table[original]
    for groups in world.tags_to_pg.values():
        if original in groups:
            groups.append(stand_in)
    if world.default_pg is original:
        world.default_pg = stand_in
    name = world.pg_names[original]
    distributed_c10d._unregister_process_group(name)
    distributed_c10d._register_process_group(name, stand_in)


def unregister_stand_in(original: dist.ProcessGroup, stand_in: dist.ProcessGroup) -> None:
    """Undo ``register_stand_in``: the registry resolves ``original`` again (if it has not been destroyed since)."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    for table in (world.pg_map, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.pg_coalesce_state):
        table.pop(stand_in, None)
    for groups in world.tags_to_pg.values():
        groups[:] = [group for group in groups if group is not stand_in]
    if world.default_pg is stand_in:
        world.default_pg = original
    if original in world.pg_names:
        name = world.pg_names[original]
        distributed_c10d._unregister_process_group(name)
        distributed_c10d._register_process_group(name, original)


def share_backends(source: dist.ProcessGroup, target: dist.ProcessGroup) -> None:
    """Give ``target`` (a new Python ``ProcessGroup``) ``source``'s backends for each device type, its default
    backend, bound device, name and description: a collective on ``target`` runs on the very connections ``source``'s
    would. The bound device first: registering a backend sets the group's bound device on it (NCCL's eager init)."""
    def backend_type(name: str) -> dist.ProcessGroup.BackendType:
        return dist.Backend.backend_type_map.get(name.lower(), dist.ProcessGroup.BackendType.CUSTOM)

    target.bound_device_id = source.bound_device_id
    for device in source._device_types:
        backend = source._get_backend(device)
        target._register_backend(device, backend_type(backend.name()), backend)
    target._set_default_backend(backend_type(source._get_backend_name()))
    target._set_group_name(source.group_name)
    target._set_group_desc(source.group_desc)


def start_coalescing(group: dist.ProcessGroup, device: torch.device) -> None:
    """Collect the collectives issued on ``group`` until ``end_coalescing`` into one (``_coalescing_manager``)."""
    group._start_coalescing(device)


def end_coalescing(group: dist.ProcessGroup, device: torch.device) -> Any:
    """Issue what ``start_coalescing`` collected on ``group``; the work of the whole."""
    return group._end_coalescing(device)


def device_types(group: dist.ProcessGroup) -> list[str]:
    """The device types ``group`` has a backend for, e.g. ``["cuda", "cpu"]`` for gloo (it moves both)."""
    return [device.type for device in group._device_types]


def backend_name(group: dist.ProcessGroup, device: torch.device) -> str:
    """The name of the backend that moves ``device``'s tensors in ``group``, lower case: ``gloo``, ``nccl``, ..."""
    return group._get_backend(device).name().lower()


# ---- Lightning (imported inside each helper) --------------------------------------------------------------


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """What Lightning's ``DDPStrategy`` passes to torch's ``DistributedDataParallel`` (``bucket_cap_mb``, ...)."""
    return dict(getattr(strategy, "_ddp_kwargs", None) or {})


def ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook given to Lightning's ``DDPStrategy(ddp_comm_hook=...)``, ``None`` without one."""
    return getattr(strategy, "_ddp_comm_hook", None)


def rename_logger(logger: Any, name: str) -> None:
    """Give a ``TensorBoardLogger`` or ``CSVLogger`` the experiment name ``name`` before it writes anything (the
    loggers take their name only in the constructor)."""
    logger._name = name


def strategy_setting(strategy: Any, name: str) -> Any:
    """A Lightning strategy's value of the ``StrategyRegistry`` init argument ``name``, which Lightning keeps in the
    private ``_<name>`` (``_start_method``) or the public ``<name>``; a unique sentinel where it has neither."""
    return getattr(strategy, f"_{name}", getattr(strategy, name, object()))


def redirect_through_forward(wrapper: torch.nn.Module, module: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
    """``module.<method_name>(*args, **kwargs)`` run inside ``wrapper``'s ``__call__`` (its forward hooks around the
    step), as Lightning runs a step through ``DistributedDataParallel`` (``_ForwardRedirection``); ``wrapper`` may be
    ``module`` itself."""
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    return _ForwardRedirection()(wrapper, module, method_name, *args, **kwargs)


def drop_placeholder_hp_metric(logger: Any) -> None:
    """Stop a ``TensorBoardLogger`` from writing its placeholder ``hp_metric`` (-1) with the hyperparameters."""
    logger._default_hp_metric = False


def logger_prefix(logger: Any) -> str:
    """The prefix a Lightning logger puts before every metric it writes (``""`` without one)."""
    return getattr(logger, "_prefix", "")


def event_file_writer(logger: Any) -> Any:
    """A ``TensorBoardLogger``'s event file writer, which takes raw summaries (as its ``log_hyperparams`` does)."""
    return logger.experiment._get_file_writer()


def last_saved_step(callback: Any) -> int:
    """The optimizer step a ``ModelCheckpoint`` last saved."""
    return callback._last_global_step_saved


def save_checkpoint_now(callback: Any, trainer: Any) -> None:
    """Save through ``callback`` (a ``ModelCheckpoint``) now, as it does itself after a validation: every rank takes
    part (sharded strategies gather the state), rank 0 writes."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def should_accumulate(trainer: Any) -> bool:
    """True while gradient accumulation is still collecting micro-batches of the current optimizer step."""
    return bool(trainer.fit_loop._should_accumulate())


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is the stand-in Lightning uses when ``configure_optimizers`` returned ``None``."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    return isinstance(optimizer, _MockOptimizer)


def compute_dtype(trainer: Any) -> torch.dtype:
    """The dtype the matrix multiplications of this run use (bf16 under ``bf16-mixed``, fp32 under ``32-true``)."""
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(trainer.precision_plugin)


def launched_processes(strategy: Any) -> list[subprocess.Popen]:
    """The sibling rank processes this process's Lightning launcher started (empty where it started none)."""
    return list(getattr(getattr(strategy, "_launcher", None), "procs", None) or [])


def repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` drive ``optimizer``, wrapping its ``step`` as ``LRScheduler`` does (no warning given)."""
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step.__func__  # type: ignore[attr-defined]
    opt_ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
