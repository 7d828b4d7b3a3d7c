"""Checkpoints of a ``ShardedOptimizer``: consolidate every rank's shard into the unsharded format, and back.

``consolidated_state_dict`` is what ``ShardedOptimizer.state_dict()`` returns: the full state, on CPU, in exactly
the format ``optimizer_cls`` would produce for all parameters, so a checkpoint resumes under any world size, either
schedule, or plain DDP with an unsharded optimizer. ``load_shard`` takes such a state (Lightning loads the file on
every rank) and keeps the entries the rank owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_ddp.sync.zero1.optimizer import ShardedOptimizer

__all__ = ["GROUP_KEYS_NOT_HYPERPARAMETERS", "consolidated_state_dict", "load_shard"]

GROUP_KEYS_NOT_HYPERPARAMETERS = ("params", "param_names")


def consolidated_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """The full state on every rank. A collective: every rank must call it.

    One ``all_gather_object`` of the owned entries' shapes, then one ``broadcast`` per state tensor from its owner.
    """
    inner = optimizer.optim
    assert inner is not None
    comm = optimizer.comm
    local: dict[int, dict[str, tuple]] = {}
    for param, entry in inner.state.items():
        local[optimizer._index[id(param)]] = {
            key: ("tensor", tuple(value.shape), value.dtype) if torch.is_tensor(value) else ("value", value)
            for key, value in entry.items()
        }
    described: list[dict[int, dict[str, tuple]]] = [{} for _ in range(comm.world_size)]
    dist.all_gather_object(described, local, group=comm.group)
    device = optimizer.device  # NCCL needs CUDA tensors, even for Adam's CPU `step` counters
    state: dict[int, dict[str, Any]] = {}
    for r in range(comm.world_size):
        for index in sorted(described[r]):
            entry: dict[str, Any] = {}
            for key, (kind, *rest) in described[r][index].items():
                if kind == "value":
                    entry[key] = rest[0]
                    continue
                shape, dtype = rest
                if r == comm.rank:
                    buffer = inner.state[optimizer._params[index]][key].detach().to(device, copy=True)
                else:
                    buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buffer, src=comm.global_rank(r), group=comm.group)
                entry[key] = buffer.cpu()
            state[index] = entry
    param_groups = []
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [optimizer._index[id(p)] for p in group["params"]]
        param_groups.append(packed)
    return {"state": state, "param_groups": param_groups}


def load_shard(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a full state (from ``state_dict()`` or an unsharded ``optimizer_cls``); keep the owned entries.

    Not a collective. The hyperparameters of every group come from ``state_dict``, as in torch.
    """
    inner = optimizer.optim
    assert inner is not None
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the state has {len(saved_groups)} parameter groups but this optimizer has {len(optimizer.param_groups)}; "
            "load a checkpoint of the same model and configure_optimizers."
        )
    saved_index: dict[int, Any] = {}  # id(param) -> its index in state_dict
    for number, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
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
    for group, inner_group in zip(optimizer.param_groups, inner.param_groups):
        positions = []
        for param in inner_group["params"]:
            index = saved_index[id(param)]
            if index in state_dict["state"]:
                inner_state[position] = state_dict["state"][index]
            positions.append(position)
            position += 1
        packed = {k: v for k, v in group.items() if k not in GROUP_KEYS_NOT_HYPERPARAMETERS}
        packed["params"] = positions
        inner_groups.append(packed)
    inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
