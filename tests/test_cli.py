"""The CLI: every YAML in configs/ parses, and the quickstart trains end to end on 2 CPU processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ddp.cli import main
from tests.cli_utils import REPO, read_scalars, run_cli

MAIN_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
STRATEGY_FRAGMENTS = sorted((REPO / "configs" / "strategy").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch) -> None:
    # LightningCLI warns when it gets both `args` and pytest's own sys.argv.
    monkeypatch.setattr("sys.argv", ["lightning_ddp"])


def parse_only(*args: str) -> None:
    """Parse (and validate) a command line without instantiating anything: ``--print_config`` exits 0 after parsing."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)


@pytest.mark.parametrize("config", MAIN_CONFIGS, ids=lambda p: p.name)
def test_every_main_config_parses(config: Path, capsys) -> None:
    parse_only("--config", str(config))


@pytest.mark.parametrize("fragment", STRATEGY_FRAGMENTS, ids=lambda p: p.name)
def test_every_strategy_fragment_parses_on_top_of_quickstart(fragment: Path, capsys) -> None:
    parse_only("--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(fragment))


def test_torch_ddp_option_on_our_strategy_is_a_config_error(capsys) -> None:
    # Our strategies have explicit signatures: a torch-DDP keyword must not be silently swallowed.
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--config",
             str(REPO / "configs" / "strategy" / "bucketed.yaml"),
             "--trainer.strategy.init_args.find_unused_parameters", "true", "--print_config"]
        )
    assert exit_info.value.code != 0
    assert "find_unused_parameters" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_quickstart_trains_on_two_processes_and_logs_loss(tmp_path: Path) -> None:
    run_cli(
        "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
        "--trainer.max_steps", "3", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
        cwd=tmp_path,
    )
    scalars = read_scalars(tmp_path / "logs")
    # log_every_n_steps=1: one train/loss point per optimizer step
    assert [step for step, _ in scalars["train/loss"]] == [0, 1, 2]


@pytest.mark.multiprocess
def test_text_bytes_loss_goes_down(tmp_path: Path) -> None:
    # Raw bytes of this repo's README: vocab 256, no tokenizer. Starting loss is about ln(256) = 5.5; a tiny model
    # learns byte statistics within a few dozen steps, so the last losses must be far below the first.
    run_cli(
        "fit", "--config", str(REPO / "configs" / "text_bytes.yaml"),
        "--data.path", str(REPO / "README.md"), "--trainer.max_steps", "40",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
        cwd=tmp_path,
    )
    losses = [value for _, value in sorted(read_scalars(tmp_path / "logs")["train/loss"])]
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses
