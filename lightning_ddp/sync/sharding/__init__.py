"""Optimizer-state sharding shared by ZeRO-1 (``sync/zero1.py``) and ZeRO-2 (``sync/zero2.py``).

``ShardedOptimizer`` wraps any ``torch.optim.Optimizer`` class so each rank keeps state only for the parameters it
owns; its schedules and settings are in ``.optimizer``. Schedules, memory and traffic: ``docs/algorithms.md``.
"""

from lightning_ddp.sync.sharding.optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
