"""Test-only callbacks, used through the CLI: ``--trainer.callbacks+=tests.support.callbacks_for_tests.FailAt``.

The final weights of a fit are saved by the study's ``lightning_ddp.bench.gpu_study.processes.SaveFinalWeights``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import lightning.pytorch as pl
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
