"""Lightning callbacks: ``CommTimer`` (per-step communication metrics), ``TraceRecorder`` (profiler traces with a
communication track), ``FinalStepCheckpoint`` and ``SlowRank`` (an injected straggler). What they log is computed,
pure, in ``lightning_ddp.metrics``.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_ddp import compat
from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.callbacks.trace_recorder import TraceRecorder
from lightning_ddp.sync.base import check_number

__all__ = ["CommTimer", "FinalStepCheckpoint", "SlowRank", "TraceRecorder"]


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
        if self.rank >= trainer.world_size:
            raise ValueError(f"SlowRank(rank={self.rank}) names no rank of this {trainer.world_size}-rank run; choose "
                             f"a rank below {trainer.world_size}")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_rank != self.rank or self.delay_ms == 0 or compat.should_accumulate(trainer):
            return
        if trainer.global_step % self.every_n_steps != 0:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time.sleep(self.delay_ms / 1e3)
        self.delayed_steps.append(trainer.global_step)


class FinalStepCheckpoint(Callback):
    """Save the last optimizer step through every unmonitored ``ModelCheckpoint`` that has not saved it yet (alone, it
    would lose the steps after the last validation of a run stopped by ``max_steps``). At the end of the last
    training batch, or when training ends for any other stop; an exception saves nothing.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        # The batch just ended is the run's last: it made the max_steps-th optimizer step, or it ends the last epoch.
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs > 0
        if 0 <= trainer.max_steps <= trainer.global_step or (
            last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        ):
            _save_unsaved(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _save_unsaved(trainer)


def _save_unsaved(trainer: pl.Trainer) -> None:
    if trainer.fast_dev_run or trainer.sanity_checking or trainer.global_step == 0:
        return  # Lightning saves nothing for a dry run; step 0 has nothing trained to keep
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.monitor is not None:
            continue
        if callback._last_global_step_saved == trainer.global_step:
            continue  # a validation or an every_n_train_steps save already wrote this step
        # The calls ModelCheckpoint makes itself after a validation: every rank takes part (sharded strategies
        # gather the state), rank 0 writes.
        candidates = callback._monitor_candidates(trainer)
        callback._save_topk_checkpoint(trainer, candidates)
        callback._save_last_checkpoint(trainer, candidates)
