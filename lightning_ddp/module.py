"""The GPT language model as a LightningModule: loss, optimizer, schedule, logging; nothing of how gradients are
synchronised. Evaluation logs ``val/loss`` (mean cross-entropy in nats over every token of the split, all ranks)
and ``val/ppl`` once per epoch; ``test/*`` for ``test``.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_ddp.model import GPT, get_config


class LitGPT(pl.LightningModule):
    """Next-token prediction with a GPT-family decoder, trained with AdamW.

    Args:
        preset: Model size by name: tiny, small, medium, large, xl, 2.7b (see ``lightning_ddp.model.PRESETS``).
        vocab_size: Vocabulary size. The CLI links it from ``data.vocab_size``, so the data decides it.
        context_length: Longest sequence the model accepts (rotary cache size); ``data.seq_len`` must not exceed it.
        tie_embeddings: Share one matrix between the token embedding and the output layer.
        lr: Peak learning rate of AdamW.
        betas: AdamW's (beta1, beta2).
        weight_decay: Decoupled weight decay, applied to matrices only (not to norm weights).
        warmup_steps: Optimizer steps of linear learning-rate warm-up from 0 to ``lr``.
        lr_schedule: ``constant`` after warm-up, or ``cosine`` decay to ``min_lr_ratio * lr`` at the last step,
            ``trainer.max_steps``: the schedule is fixed by it, and resuming with another ``max_steps`` warns.
        min_lr_ratio: Final learning rate of the cosine schedule, as a fraction of ``lr``.
    """

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: int = 10_000,
        context_length: int = 256,
        tie_embeddings: bool = False,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule={lr_schedule!r} is not supported; use 'constant' or 'cosine'.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        self.save_hyperparameters()
        self.config = get_config(
            preset, vocab_size=vocab_size, context_length=context_length, tie_embeddings=tie_embeddings
        )
        self.model = GPT(self.config)
        self._last_batch_end: float | None = None
        # (sum of token losses, token count) of this rank's shard this evaluation epoch; float64 loses nothing
        self._eval_totals: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward) of the model; the CommTimer uses it for MFU."""
        return self.model.flops_per_token(seq_len)

    def tokens_per_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Tokens of one micro-batch (B * T of its input): how the CommTimer counts ``step/tokens_per_s``."""
        return batch[0].numel()

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self.model(x)  # (B, T, V), float32 (GPT.forward): the log-softmax in full precision
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The mean next-token cross-entropy of ``(x, y)``, each ``(B, T)``; logged as ``train/loss``."""
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # Throughput as the training loop sees it: the global batch's tokens per second between the ends of
        # consecutive batches (the CommTimer's step/tokens_per_s measures each optimizer step more carefully).
        now = time.perf_counter()
        if self._last_batch_end is not None:
            self.log("train/tokens_per_s", batch[0].numel() * self.trainer.world_size / (now - self._last_batch_end))
        self._last_batch_end = now

    @override
    def on_validation_start(self) -> None:
        self._last_batch_end = None  # the next training batch's throughput would count the validation's time

    @override
    def on_validation_epoch_start(self) -> None:
        self._eval_totals = torch.zeros(2, dtype=torch.float64, device=self.device)

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens = batch[1].numel()
        loss = self._loss(batch)  # mean over the batch's tokens
        token_count = loss.new_tensor(tokens, dtype=torch.float64)
        self._eval_totals += torch.stack([loss.detach().double() * tokens, token_count])

    @override
    def on_validation_epoch_end(self) -> None:
        # One all-reduce of (loss sum, tokens) over the ranks' shards: the mean over every held-out token, exactly
        # (Lightning's per-step sync_dist would give the same mean, but not the perplexity of it).
        totals = self.trainer.strategy.reduce(self._eval_totals, reduce_op="sum")
        loss = (totals[0] / totals[1]).float()
        stage = "test" if self.trainer.testing else "val"
        # The value is already the same on every rank; sync_dist=True only says so to Lightning, which otherwise
        # warns that an epoch-level metric was not synchronised (averaging equal values changes nothing).
        self.log(f"{stage}/loss", loss, sync_dist=True, prog_bar=True)
        self.log(f"{stage}/ppl", torch.exp(loss), sync_dist=True, prog_bar=True)
        self._eval_totals = None

    # ``test`` evaluates its split as ``validate`` does, and logs ``test/*``.
    on_test_epoch_start = on_validation_epoch_start
    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The cosine schedule runs to the trainer's max_steps; kept so that a resume can tell when it changes.
        checkpoint["lr_schedule_max_steps"] = self.trainer.max_steps

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("lr_schedule_max_steps")
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or self.hparams.lr_schedule != "cosine":
            return
        if saved is not None and saved != trainer.max_steps:
            rank_zero_warn(
                f"Resuming a run whose cosine learning-rate schedule was fixed by --trainer.max_steps {saved} with "
                f"max_steps {trainer.max_steps}: the schedule changes from the checkpoint's step on (the rate jumps "
                f"to where a {trainer.max_steps}-step run would be). Resume with --trainer.max_steps {saved} to "
                "finish the run as planned."
            )

    def configure_optimizers(self):
        """AdamW, weight decay on the matrices only; with a warm-up or a decay, its per-step ``lr_factor`` schedule."""
        hp = self.hparams
        # Weight decay on matrices only: decaying norm gains pulls them to 0, which only hurts.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=tuple(hp.betas))
        if hp.warmup_steps == 0 and hp.lr_schedule == "constant":
            return optimizer
        total = self.trainer.estimated_stepping_batches
        factor = functools.partial(lr_factor, warmup_steps=hp.warmup_steps, total_steps=total, schedule=hp.lr_schedule,
                                   min_ratio=hp.min_lr_ratio)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def lr_factor(step: int, warmup_steps: int, total_steps: float, schedule: str, min_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step``: linear warm-up, then constant or cosine decay to
    ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or not math.isfinite(total_steps) or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
