"""Every private or version-dependent torch and Lightning API this package uses, behind one small module. It
imports only torch at the top (Lightning inside each helper), so the pure-PyTorch core can import it.
"""

from __future__ import annotations

import functools
import subprocess
import weakref
from typing import Any

import torch
import torch.distributed as dist


# ---- torch ---------------------------------------------------------------------------------------------


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording right now (a flag read, ~0.1 us)."""
    return torch.autograd._profiler_enabled()


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


# ---- Lightning (imported inside each helper) --------------------------------------------------------------


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
