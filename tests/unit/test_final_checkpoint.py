"""``FinalStepCheckpoint``: with checkpointing on, a run's last step is saved whether or not it ends on a validation.

The quickstart's schedule, in one process on a toy model: validation (hence Lightning's own save) every 40 steps
counted across epochs. A run of 12 steps never validates, one of 40 ends on a validation, one of 50 ends 10 steps
after one.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp.callbacks import FinalStepCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch) -> None:
    # LightningCLI warns when it gets both `args` and pytest's own sys.argv.
    monkeypatch.setattr("sys.argv", ["lightning_ddp"])


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, max_steps: int, final: bool) -> tuple[list[str], Regression]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 8 steps per epoch
    module = Regression()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=40, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, limit_val_batches=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints")] + ([FinalStepCheckpoint()] if final else []),
    )
    trainer.fit(module, data, data)
    return sorted(path.name for path in (tmp_path / "checkpoints").glob("*.ckpt")), module


@pytest.mark.parametrize("max_steps,expected", [
    # 12 steps: no validation ran, so Lightning alone saved nothing; the final save is step 12 (epoch 1: 8 steps
    # per epoch).
    (12, ["epoch=1-step=12.ckpt"]),
    # 40: the validation at step 40 already saved it; no second file of the same step.
    (40, ["epoch=4-step=40.ckpt"]),
    # 50: step 40 saved at the validation, step 50 at the end; save_top_k=1 (no monitor) keeps the newest only.
    (50, ["epoch=6-step=50.ckpt"]),
])
def test_the_last_step_is_saved(tmp_path: Path, max_steps: int, expected: list[str]) -> None:
    names, module = _fit(tmp_path, max_steps, final=True)
    assert names == expected
    saved = torch.load(tmp_path / "checkpoints" / names[0], weights_only=False)
    assert saved["global_step"] == max_steps
    # The file holds the trained weights, the ones the run ended with.
    for key, value in module.state_dict().items():
        assert torch.equal(saved["state_dict"][key], value)


@pytest.mark.parametrize("max_steps,without", [(12, []), (50, ["epoch=4-step=40.ckpt"])])
def test_without_it_lightning_keeps_only_what_a_validation_saved(tmp_path: Path, max_steps: int,
                                                                 without: list[str]) -> None:
    # Why the callback exists: the 20-step run saved nothing, the 50-step one stopped at step 40.
    assert _fit(tmp_path, max_steps, final=False)[0] == without


def test_the_cli_adds_it(tmp_path: Path) -> None:
    from lightning_ddp.cli import LightningDDPCLI
    from lightning_ddp.data import LMDataModule
    from lightning_ddp.module import LitGPT

    cli = LightningDDPCLI(LitGPT, LMDataModule, run=False, args=[
        "--config", str(Path(__file__).parents[2] / "configs" / "quickstart.yaml"), "--trainer.devices", "1",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_checkpointing", "true",
    ])
    assert sum(isinstance(c, FinalStepCheckpoint) for c in cli.trainer.callbacks) == 1
