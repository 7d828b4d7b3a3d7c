"""``fsdp2``: torch's FSDP2 (``fully_shard``) as a baseline strategy, on CPU (gloo) and CUDA; checkpoints are
consolidated full state dicts (``ddp``'s file). The recipe: ``docs/algorithms.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Generator

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp import catalogue, compat
from lightning_ddp.strategies.base import DataParallelStrategy
from lightning_ddp.sync.base import broadcast_module_states
from lightning_ddp.sync.comm import backend_for

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEFAULT_SHARD_MODULES: tuple[str, ...] = ("Block",)
"""Class names sharded one FSDP group each by default (our GPT's ``Block``)."""


class FSDP2Strategy(DataParallelStrategy):
    """Fully sharded data parallelism with torch's FSDP2 (``trainer.strategy: fsdp2``).

    Args:
        shard_modules: Class names of the modules sharded one FSDP group each; default ``[Block]``.
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3's memory); ``false`` keeps them.
        mixed_precision: Under ``bf16-mixed``, gather and compute in bf16, reduce in fp32.
        **kwargs: The arguments of ``DataParallelStrategy``.
    """

    def __init__(
        self,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shard_modules: tuple[str, ...] = DEFAULT_SHARD_MODULES if shard_modules is None else tuple(shard_modules)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.mixed_precision = bool(mixed_precision)
        self.device_mesh: DeviceMesh | None = None
        """The mesh ``fully_shard`` shards over; ``None``: the world, one dimension (``hsdp`` sets a 2-D one)."""
        self._sharded = False

    @override
    def reported_settings(self) -> tuple[float | str, dict[str, Any]]:
        return catalogue.NOT_APPLICABLE, {"reshard_after_forward": self.reshard_after_forward,
                                          "mixed_precision": self.mixed_precision}

    # -- set-up ----------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        mixed_precision_dtypes(str(self.precision_plugin.precision), self.mixed_precision)  # refuses 16-mixed
        super().setup_environment()

    @override
    def configure_ddp(self) -> None:
        module = self.lightning_module
        assert isinstance(module, pl.LightningModule)
        param_dtype, reduce_dtype = mixed_precision_dtypes(str(self.precision_plugin.precision), self.mixed_precision)
        message = shard(module, self.shard_modules, self.reshard_after_forward, param_dtype, reduce_dtype,
                        mesh=self.device_mesh)
        if message:
            rank_zero_info(f"{self.strategy_name}: {message}")
        self.model = module
        self._sharded = True

    # -- the steps through the root's __call__ (FSDP2's root hooks), once sharded ----------------------------
    # Lightning redirects a step through the wrapper's forward only when the model is wrapped (``DDPStrategy``);
    # ``fully_shard`` shards the LightningModule in place, so its steps are redirected through itself.

    def _through_root(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """``lightning_module.<method_name>(...)``; once sharded, inside the root module's ``__call__`` (Lightning's
        forward redirection), where FSDP2's root hooks run whether or not the step calls ``self(...)``."""
        module = self.lightning_module
        assert module is not None
        if not self._sharded:
            return getattr(module, method_name)(*args, **kwargs)
        return compat.redirect_through_forward(module, module, method_name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_root("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_root("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", *args, **kwargs)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A micro-batch before the last: accumulate the unsharded gradients locally (FSDP2's ``no_sync``)."""
        if not self._sharded:
            yield None
            return
        module = self.lightning_module
        module.set_requires_gradient_sync(False)  # type: ignore[operator]  (recurses into every FSDP group)
        try:
            yield None
        finally:
            module.set_requires_gradient_sync(True)  # type: ignore[operator]

    # -- checkpoints: consolidated, as an unsharded run writes them -----------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on rank 0 (``{}`` elsewhere); a collective, called on every rank."""
        if not self._sharded:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.lightning_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's full state on rank 0 in torch's integer-keyed form (``{}`` elsewhere); a collective."""
        if not self._sharded:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = _torch_optimizer(optimizer)
        full = get_optimizer_state_dict(
            self.lightning_module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return fqn_keys_to_ids(full) if full else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._sharded:
            return super().load_optimizer_state_dict(checkpoint)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # Every rank loaded the file: each takes its own shard of the full state, no broadcast needed.
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = _torch_optimizer(optimizer)
            set_optimizer_state_dict(
                self.lightning_module, optimizer, ids_to_fqn_keys(saved, optimizer, self.lightning_module),
                options=StateDictOptions(full_state_dict=True),
            )


# ---- the sharding, and pure helpers (unit-tested without processes) -------------------------------------------


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer, also where a ``LightningOptimizer`` wraps it."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def shard(
    module: nn.Module,
    class_names: tuple[str, ...] = DEFAULT_SHARD_MODULES,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    *,
    mesh: DeviceMesh | None = None,
) -> str:
    """Shard ``module`` in place on every rank over ``mesh`` (``None``: the world; a 2-D ``(replicate, shard)`` mesh:
    hybrid sharding); returns ``modules_to_shard``'s message."""
    from torch.distributed.fsdp import fully_shard

    if dist.is_available() and dist.is_initialized():
        broadcast_module_states(module)  # rank 0's weights everywhere, before sharding splits them
    blocks, message = modules_to_shard(module, class_names)
    options: dict[str, Any] = {}
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(module, mesh=mesh, **options)  # the root: the parameters outside the blocks (tied weights stay one)
    parameter = next(module.parameters(), None)
    if parameter is not None and backend_for(parameter.device) == "gloo":
        # Reduce-scatter (and a 2-D mesh's all-reduce) with SUM, then divide in FSDP2 (gloo's AVG sums: pytorch#162338)
        for group in (*blocks, module):
            switch = getattr(group, "set_force_sum_reduction_for_comms", None)
            if switch is not None:
                switch(True)
    return message


def modules_to_shard(module: nn.Module, class_names: tuple[str, ...]) -> tuple[list[nn.Module], str]:
    """The outermost submodules of ``class_names`` (else the repeated layers, else none), and a message when they
    are not of ``class_names`` ("" when they are)."""
    chosen = _outermost(module, lambda sub: type(sub).__name__ in class_names)
    if chosen:
        return chosen, ""
    repeated = {id(child) for sub in module.modules() if sub is not module for child in _repeated_layers(sub)}
    chosen = _outermost(module, lambda sub: id(sub) in repeated)
    if chosen:
        classes = sorted({type(m).__name__ for m in chosen})
        return chosen, (
            f"no module of class {', '.join(class_names)} in {type(module).__name__}; sharding its "
            f"{len(chosen)} repeated layers ({', '.join(classes)}) one group each. `shard_modules` names others."
        )
    # `any(m.parameters(...))` would take each tensor's truth value: an error for more than one element.
    owning = [m for m in module.modules() if m is not module and any(True for _ in m.parameters(recurse=False))]
    classes = sorted({type(m).__name__ for m in owning})
    return [], (
        f"no module of class {', '.join(class_names)} in {type(module).__name__}; sharding it at the root "
        f"only (every parameter gathered at once). Name its repeated blocks with `shard_modules`, e.g. one of: "
        f"{', '.join(classes[:8]) or '(no parameters)'}."
    )


def _outermost(module: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The submodules of ``module`` that are ``wanted``, in order, none inside an earlier chosen one."""
    chosen: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if sub is module or id(sub) in inside:
            continue
        if wanted(sub):
            chosen.append(sub)
            inside.update(id(m) for m in sub.modules())
    return chosen


def _repeated_layers(container: nn.Module) -> list[nn.Module]:
    """The children of a ``ModuleList``/``Sequential`` when those holding parameters are ≥ 2, all of one class."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return []
    layers = [child for child in container.children() if any(True for _ in child.parameters())]
    if len(layers) < 2 or len({type(layer) for layer in layers}) > 1:
        return []
    return layers


def mixed_precision_dtypes(precision: str, enabled: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """FSDP2's ``(param_dtype, reduce_dtype)``: bf16/fp32 under ``bf16-mixed`` when ``enabled``, else
    ``(None, None)``. Raises ``ValueError`` for ``16-mixed``.

    >>> mixed_precision_dtypes("bf16-mixed", True)
    (torch.bfloat16, torch.float32)
    >>> mixed_precision_dtypes("32-true", True)
    (None, None)
    """
    if precision in ("16-mixed", "16"):
        raise ValueError(
            "FSDP2 (fully_shard) does not support trainer.precision 16-mixed (fp16 with a gradient scaler over sharded "
            "gradients is not checked here); use --trainer.precision bf16-mixed."
        )
    if precision in ("bf16-mixed", "bf16") and enabled:
        return torch.bfloat16, torch.float32
    return None, None


def fqn_keys_to_ids(state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter names, numbered in param-group order as
    ``Optimizer.state_dict()`` numbers them; each ``step`` tensor copied.

    >>> fqn_keys_to_ids({"state": {"b": {"step": 1}}, "param_groups": [{"lr": 1, "params": ["a", "b"]}]})
    {'state': {1: {'step': 1}}, 'param_groups': [{'lr': 1, 'params': [0, 1]}]}
    """
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        numbered = [ids.setdefault(name, len(ids)) for name in group["params"]]
        groups.append({**group, "params": numbered})
    return {"state": {ids[name]: _own_step(value) for name, value in state["state"].items()}, "param_groups": groups}


def ids_to_fqn_keys(state: Mapping[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """The inverse of ``fqn_keys_to_ids`` for ``module``'s ``optimizer``; ``ValueError`` when the groups differ."""
    names = {p: name for name, p in module.named_parameters()}  # a tied tensor once, by its first name
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_groups = state["param_groups"]
    saved_count = sum(len(group["params"]) for group in saved_groups)
    if len(saved_groups) != len(optimizer.param_groups) or saved_count != len(params):
        raise ValueError(
            f"the checkpoint's optimizer state has {len(saved_groups)} parameter groups of {saved_count} parameters, "
            f"this run's optimizer {len(optimizer.param_groups)} of {len(params)}; resume with the same model and "
            "configure_optimizers, or load the weights only."
        )
    saved_ids = [index for group in saved_groups for index in group["params"]]
    by_id = {index: names[param] for index, param in zip(saved_ids, params)}
    return {
        "state": {by_id[index]: _own_step(value) for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [by_id[i] for i in group["params"]]} for group in saved_groups],
    }


def _own_step(entry: Any) -> Any:
    """One parameter's optimizer state with its ``step`` tensor copied: AdamW advances it in place.

    >>> step = torch.tensor(2.0)
    >>> _own_step({"step": step})["step"] is step, _own_step({"step": step})["step"].item()
    (False, 2.0)
    """
    if isinstance(entry, Mapping) and isinstance(entry.get("step"), Tensor):
        return {**entry, "step": entry["step"].detach().clone()}
    return entry
