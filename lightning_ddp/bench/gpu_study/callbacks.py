"""A callback of the study's fits: ``SaveFinalWeights``, for comparing what two runs trained."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["SaveFinalWeights"]


class SaveFinalWeights(Callback):
    """At the end of fit, rank 0 saves the LightningModule's whole ``state_dict`` (on the CPU) to ``path``; the
    strategy gathers it, as for a checkpoint (under ``fsdp2`` the module's own holds each rank's shard).

    ``--trainer.callbacks+=lightning_ddp.bench.gpu_study.callbacks.SaveFinalWeights --trainer.callbacks.path FILE``

    Args:
        path: The file to write (``torch.save`` of a dict of tensors; read it with ``torch.load(weights_only=True)``).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # every rank: a collective under fsdp2
        if trainer.is_global_zero:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.detach().cpu() for k, v in state.items()}, self.path)
