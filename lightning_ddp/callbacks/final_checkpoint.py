"""``FinalStepCheckpoint``: whenever checkpointing is on, the run's last optimizer step is saved.

Lightning's ``ModelCheckpoint`` saves after a validation or at an epoch's end. A run that stops at ``max_steps``
between two validations (our configs validate every ``val_check_interval`` steps, across epochs) would lose every
step after the last validation: a 50-step quickstart kept ``step=40.ckpt``, a 20-step one nothing at all. This
callback asks each of the trainer's ``ModelCheckpoint`` callbacks that does not monitor a metric to save once more
when training ends, unless it already saved this very step. A monitored one keeps its choice of the best (the
last step has no value of its metric to rank it by); its ``save_last`` copy is its own business.

A run that stops on an exception keeps the checkpoints it had: nothing is saved at the failure (the other ranks
may be gone, and a collective save would hang) and nothing already saved is removed.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override


class FinalStepCheckpoint(Callback):
    """Save the last optimizer step through every unmonitored ``ModelCheckpoint`` that has not saved it yet.

    Does nothing when checkpointing is off (no ``ModelCheckpoint``). The file is the checkpoint callback's own
    (its ``dirpath`` and ``filename``, e.g. ``<log_dir>/checkpoints/epoch=1-step=12.ckpt``); with the default
    ``save_top_k=1`` it replaces the previous one, as any later save would.

    The save happens at the end of the last training batch (``max_steps`` reached, or the last batch of the last
    epoch), where ``every_n_train_steps`` saves: the loops' state there resumes mid-epoch exactly. A run stopped by
    anything else (early stopping, ``max_time``) is saved when training ends, as Lightning's ``save_last`` is.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if _is_last_batch(trainer):
            _save_unsaved(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _save_unsaved(trainer)


def _is_last_batch(trainer: pl.Trainer) -> bool:
    """The batch just ended is the run's last: it made the ``max_steps``-th optimizer step, or it ends the last
    epoch."""
    if 0 <= trainer.max_steps <= trainer.global_step:
        return True
    last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs > 0
    return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


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
