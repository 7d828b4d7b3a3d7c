"""Checkpoints of a ``ShardedOptimizer``: consolidate every rank's shard into the unsharded format, and back.

The consolidated state has ``optimizer_cls``'s own format, so a checkpoint resumes under any world size, either
schedule, or plain DDP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_ddp.sync.gather import gather_rank_states

if TYPE_CHECKING:
    from lightning_ddp.sync.sharding.optimizer import ShardedOptimizer

__all__ = ["GROUP_KEYS_NOT_HYPERPARAMETERS", "consolidated_state_dict", "load_shard"]

GROUP_KEYS_NOT_HYPERPARAMETERS = ("params", "param_names")


def consolidated_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """The full state on every rank (the union of the owners' entries). A collective."""
    inner = optimizer.optim
    assert inner is not None
    local = {optimizer._index[id(param)]: dict(entry) for param, entry in inner.state.items()}
    # NCCL needs CUDA tensors, even for Adam's CPU `step` counters: broadcast on the parameters' device.
    owned = gather_rank_states(local, optimizer.comm, optimizer.device)
    assert owned is not None
    state: dict[int, dict[str, Any]] = {}
    for entries in owned:
        for index in sorted(entries):
            state[index] = entries[index]
    param_groups = []
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [optimizer._index[id(p)] for p in group["params"]]
        param_groups.append(packed)
    return {"state": state, "param_groups": param_groups}


def load_shard(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a full state and keep the owned entries (the groups' hyperparameters too). Not a collective."""
    inner = optimizer.optim
    assert inner is not None
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the state has {len(saved_groups)} parameter groups but this optimizer has "
            f"{len(optimizer.param_groups)}; "
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
