"""Optimizer-state sharding shared by ZeRO-1 (``sync/zero1.py``) and ZeRO-2 (``sync/zero2.py``).

``ShardedOptimizer`` wraps any ``torch.optim.Optimizer`` class so each rank keeps state only for the parameters it
owns. Schedules, memory and traffic: ``docs/algorithms.md``.
"""

from lightning_ddp.sync.assignment import assign_owners
from lightning_ddp.sync.sharding.optimizer import (
    COLLECTIVE_IMPLS,
    OPTIMIZER_SCHEDULES,
    SCHEDULES,
    CollectiveImpl,
    OptimizerSchedule,
    Placement,
    Schedule,
    ShardedOptimizer,
    check_collective_impl,
    check_schedule,
    resolve_collectives,
)

__all__ = [
    "COLLECTIVE_IMPLS",
    "OPTIMIZER_SCHEDULES",
    "SCHEDULES",
    "CollectiveImpl",
    "OptimizerSchedule",
    "Placement",
    "Schedule",
    "ShardedOptimizer",
    "assign_owners",
    "check_collective_impl",
    "check_schedule",
    "resolve_collectives",
]
