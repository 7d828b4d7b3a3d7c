"""``TinyLM`` as a LightningModule, its data, and the launcher variables, for Lightning fits inside a
``run_on_ranks`` job (the process group exists already; Lightning keeps it)."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.support.equivalence import TinyLM


def join_existing_group(rank: int, world_size: int) -> None:
    """Set the launcher variables Lightning reads its rank from; the process group already exists, so Lightning
    keeps it."""
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")


def tiny_lm_data(samples: int) -> TensorDataset:
    """``samples`` random (input, target) sequences of 4 tokens over TinyLM's 16, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 16, (samples, 4), generator=g), torch.randint(0, 16, (samples, 4), generator=g))


def tiny_lm_module(seed: int | None = None):
    """A LightningModule over a fresh ``TinyLM`` (initialised from ``seed`` when given: pass a per-rank seed to check
    that the strategy broadcasts rank 0's weights), AdamW at lr 1e-2; ``module.losses`` keeps each step's loss."""
    import lightning.pytorch as pl

    class TinyLMModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if seed is not None:
                torch.manual_seed(seed)
            self.model = TinyLM()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TinyLMModule()


def fit_briefly(rank: int, world_size: int, strategy: str, log_dir: str, steps: int = 3) -> int:
    """``steps`` optimizer steps of a small MLP through ``strategy`` (a catalogue name), the ``CommTimer`` recording
    every step after the first, on the process group run_on_ranks made; the steps taken (``tests/exit_loop.py``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    import lightning_ddp.strategies  # noqa: F401 - registers the catalogue's names with Lightning
    from lightning_ddp.callbacks import CommTimer

    join_existing_group(rank, world_size)

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
                         logger=CSVLogger(log_dir), log_every_n_steps=1, callbacks=[CommTimer(warmup_steps=1)],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP(), DataLoader(data, batch_size=4))
    return trainer.global_step
