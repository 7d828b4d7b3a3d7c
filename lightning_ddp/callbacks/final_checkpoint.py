"""``FinalStepCheckpoint``: the last optimizer step saved through every unmonitored ``ModelCheckpoint``."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_ddp import compat


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
        """Training stopped for another reason (``max_time``, early stopping, ...): save the step it reached."""
        _save_unsaved(trainer)


def _save_unsaved(trainer: pl.Trainer) -> None:
    """Save the current step through every unmonitored ``ModelCheckpoint`` that has not saved it; nothing for a
    dry run, a sanity check or step 0."""
    if trainer.fast_dev_run or trainer.sanity_checking or trainer.global_step == 0:
        return  # Lightning saves nothing for a dry run; step 0 has nothing trained to keep
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.monitor is not None:
            continue
        if compat.last_saved_step(callback) == trainer.global_step:
            continue  # a validation or an every_n_train_steps save already wrote this step
        compat.save_checkpoint_now(callback, trainer)
