"""Runs are told apart by strategy: an unnamed logger logs under the strategy's name, ``{strategy}`` in a name is
filled in, any other name is kept; the timer's header uses the same name (``ddp``, not ``DDPStrategy``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_ddp.metrics.recording import strategy_label
from lightning_ddp.cli import LightningDDPCLI
from lightning_ddp.data import LMDataModule
from lightning_ddp.module import LitGPT
from lightning_ddp.strategies import FSDP2Strategy, GradSyncStrategy

QUICKSTART = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch) -> None:
    # LightningCLI warns when it gets both `args` and pytest's own sys.argv.
    monkeypatch.setattr("sys.argv", ["lightning_ddp"])


@pytest.mark.parametrize("extra,expected", [
    ([], "bucketed_ddp"),  # the quickstart's logger has no name; its strategy block is GradSyncStrategy
    (["--trainer.strategy", "ddp"], "ddp"),
    (["--trainer.logger.init_args.name", "mine"], "mine"),
    (["--trainer.strategy", "naive_ddp", "--trainer.logger.init_args.name", "tb_{strategy}"], "tb_naive_ddp"),
])
def test_the_log_folder_is_named_by_strategy(tmp_path: Path, extra: list[str], expected: str) -> None:
    cli = LightningDDPCLI(LitGPT, LMDataModule, run=False, args=[
        "--config", QUICKSTART, "--trainer.devices", "1", "--trainer.logger.init_args.save_dir", str(tmp_path), *extra,
    ])
    assert cli.trainer.logger.name == expected
    assert Path(cli.trainer.logger.log_dir) == tmp_path / expected / "version_0"


def test_strategy_label_is_the_registered_name() -> None:
    assert strategy_label(DDPStrategy()) == "ddp"  # Lightning's own: looked up in its StrategyRegistry
    assert strategy_label(DDPStrategy(start_method="spawn")) == "ddp_spawn"  # the entry whose settings it has
    assert strategy_label(GradSyncStrategy("naive_ddp")) == "naive_ddp"  # ours carry strategy_name
    assert strategy_label(FSDP2Strategy()) == "fsdp2"  # a DDPStrategy subclass, not read as torch DDP
    assert strategy_label(object()) == "object"  # unknown: the class name
