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
