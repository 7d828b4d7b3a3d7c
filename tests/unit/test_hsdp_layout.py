"""``hsdp``'s layout (``lightning_ddp.strategies.hsdp``), refused or said before any process starts: pure arithmetic,
the strategy as Lightning builds it, and the CLI's one error line. No process group: the mesh itself, training and
the timer's groups are ``tests/dist/test_hsdp.py``'s."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_ddp.cli import main
from lightning_ddp.command_line import UsageError
from lightning_ddp.strategies import HSDPStrategy
from lightning_ddp.strategies.hsdp import HybridLayout

REPO = Path(__file__).parents[2]


def test_the_world_splits_into_replicas_of_shard_size_ranks() -> None:
    assert HybridLayout.of(16, 8) == HybridLayout(replicas=2, shard_size=8)  # 2 nodes of 8 GPUs
    assert HybridLayout.of(4, 1) == HybridLayout(replicas=4, shard_size=1)
    assert HybridLayout.of(4, 4) == HybridLayout(replicas=1, shard_size=4)


def test_a_shard_size_that_does_not_divide_the_world_is_refused_with_the_divisors() -> None:
    with pytest.raises(ValueError) as refused:
        HybridLayout.of(12, 5, " (3 nodes x 4 devices)")
    message = str(refused.value)
    assert "shard_size 5 does not divide the world of 12 ranks (3 nodes x 4 devices)" in message
    assert "set shard_size to one of 1, 2, 3, 4, 6, 12" in message
    assert "--trainer.strategy.init_args.shard_size 6" in message  # the largest proper divisor, as an example
    with pytest.raises(ValueError, match="shard_size 8 does not divide the world of 4 ranks"):
        HybridLayout.of(4, 8)  # larger than the world


def test_each_layout_is_said_for_what_it_is() -> None:
    assert HybridLayout(replicas=1, shard_size=2).describe().endswith("one shard group, no replica: the same as fsdp2")
    assert "replicated, as ddp" in HybridLayout(replicas=4, shard_size=1).describe()
    hybrid = HybridLayout(replicas=2, shard_size=8).describe()
    assert hybrid.startswith("hsdp: 16 ranks as 2 replicas x 8 shards") and "dp_shard" in hybrid
    assert "all-reduced across the 2 replicas (dp_replicate)" in hybrid


@pytest.mark.parametrize("shard_size", [0, -2, 1.5, True, "2"])
def test_shard_size_must_be_a_positive_count(shard_size) -> None:
    with pytest.raises(ValueError, match="shard_size must be a positive number of ranks, or null"):
        HSDPStrategy(shard_size=shard_size)


def test_the_trainer_refuses_the_layout_before_launching_any_process() -> None:
    # Building the Trainer sets the devices and nodes (Lightning's set_world_ranks): nothing is launched yet.
    with pytest.raises(ValueError, match=r"shard_size 3 does not divide the world of 4 ranks \(2 nodes x 2 devices\)"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=HSDPStrategy(shard_size=3), logger=False)


def test_by_name_the_default_shard_group_is_one_node() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=3, strategy="hsdp", logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, HSDPStrategy) and strategy.strategy_name == "hsdp"
    assert strategy.layout == HybridLayout(replicas=3, shard_size=2)  # shard_size null: --trainer.devices
    assert strategy.reported_settings() == ("n/a", {"shard_size": 2, "reshard_after_forward": True,
                                                    "mixed_precision": True})


def test_the_cli_says_the_fix_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["lightning_ddp"])
    with pytest.raises(UsageError) as refused:
        main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--config",
              str(REPO / "configs" / "strategy" / "hsdp.yaml"), "--trainer.strategy.init_args.shard_size", "3",
              "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: hsdp: shard_size 3 does not divide the world of 2 ranks"), lines
    assert "set shard_size to one of 1, 2" in lines[0]
    assert not (tmp_path / "logs").exists()  # nothing written
