"""Test-only callbacks, used through the CLI: ``--trainer.callbacks+=tests.support.callbacks_for_tests.FailAt``.

The final weights of a fit are saved by the study's ``lightning_ddp.bench.gpu_study.processes.SaveFinalWeights``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


class FailAt(Callback):
    """Make rank ``rank`` fail at the start of optimizer step ``step``: raise, or die by SIGKILL."""

    def __init__(self, step: int, rank: int = 1, mode: str = "raise") -> None:
        if mode not in ("raise", "sigkill"):
            raise ValueError(f"mode must be 'raise' or 'sigkill', got {mode!r}")
        self.step, self.rank, self.mode = step, rank, mode

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            print(f"[FailAt] failing at t={time.time():.3f}", file=sys.stderr, flush=True)
            if self.mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class GradientHistory(Callback):
    """Rank 0 keeps every optimizer step's gradients (as the optimizer gets them, before clipping) and the step's
    learning rate (one for every group), and saves them with AdamW's betas and eps (none for SGD) to ``path`` at the
    end of fit (kept in ``steps`` only, without a path): the reference history ``tests.support.tolerance`` bounds
    another run's weights from."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.steps: list[dict] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if trainer.is_global_zero:
            self.steps.append({name: p.grad.detach().cpu().clone() for name, p in pl_module.named_parameters()
                               if p.grad is not None})
            first = optimizer.param_groups[0]
            self.lrs.append(first["lr"])
            self.hyper = {key: first[key] for key in ("betas", "eps") if key in first}
            names = {id(p): name for name, p in pl_module.named_parameters()}
            self.order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.path is not None:  # ``order``: the optimizer's state indices' names
            torch.save({"steps": self.steps, "lrs": self.lrs, "order": self.order, **self.hyper}, self.path)
