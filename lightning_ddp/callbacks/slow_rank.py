"""``SlowRank``: one rank made a straggler on purpose, to check whom the ``CommTimer`` blames (``docs/comm_timer.md``,
"See it: one rank slow on purpose")."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ddp import compat
from lightning_ddp.sync.base import check_number


class SlowRank(Callback):
    """Make one rank a straggler: sleep ``delay_ms`` before its backward (the last micro-batch's; on CUDA after a
    synchronize) every ``every_n_steps`` optimizer steps, to check that the ``CommTimer`` blames the right rank for
    the right time (``docs/comm_timer.md``, "See it: one rank slow on purpose").

    Args:
        rank: The global rank that sleeps.
        delay_ms: How long it sleeps, in milliseconds (0 turns it into a no-op, the benchmark's control).
        every_n_steps: Sleep on the optimizer steps whose ``global_step`` is a multiple of this.
    """

    def __init__(self, rank: int = 1, delay_ms: float = 20.0, every_n_steps: int = 1) -> None:
        check_number("rank", rank, 0, "e.g. --trainer.callbacks.rank 1 (a global rank)")
        check_number("delay_ms", delay_ms, 0, "e.g. --trainer.callbacks.delay_ms 20", integer=False)
        check_number("every_n_steps", every_n_steps, 1, "e.g. --trainer.callbacks.every_n_steps 1")
        self.rank = rank
        self.delay_ms = float(delay_ms)
        self.every_n_steps = every_n_steps
        self.delayed_steps: list[int] = []
        """The optimizer steps this rank slept on (empty on the other ranks)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuses a ``rank`` outside this run's world."""
        if self.rank >= trainer.world_size:
            raise ValueError(f"SlowRank(rank={self.rank}) names no rank of this {trainer.world_size}-rank run; choose "
                             f"a rank below {trainer.world_size}")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """On ``rank``, at the last micro-batch of every ``every_n_steps``-th step: synchronize (CUDA), sleep
        ``delay_ms``, note the step in ``delayed_steps``."""
        if trainer.global_rank != self.rank or self.delay_ms == 0 or compat.should_accumulate(trainer):
            return
        if trainer.global_step % self.every_n_steps != 0:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time.sleep(self.delay_ms / 1e3)
        self.delayed_steps.append(trainer.global_step)
