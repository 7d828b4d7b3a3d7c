"""``advise`` on real 2-rank runs: the quickstart, one with a straggler, and the plain-Lightning example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_utils import REPO, repo_first_on_path, run_cli

pytestmark = pytest.mark.multiprocess

FAST = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--model.context_length", "32", "--data.seq_len", "32",
        "--data.batch_size", "2", "--trainer.max_steps", "12", "--timer.warmup_steps", "2",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0")
"""The quickstart's tiny GPT, short sequences, 12 steps of which 2 are warm-up."""


def _advise(run_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "lightning_ddp", "advise", str(run_dir)], env=repo_first_on_path(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "advice.md").read_text() in proc.stdout
    return json.loads((run_dir / "advice.json").read_text())


def _fit(tmp_path: Path, *args: str) -> Path:
    tmp_path.mkdir()
    run_cli("fit", *FAST, "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), *args, cwd=tmp_path)
    (summary,) = (tmp_path / "logs").rglob("timing_summary.json")
    return summary.parent


def test_advise_on_a_naive_quickstart_run(tmp_path: Path) -> None:
    document = _advise(_fit(tmp_path / "naive", "--trainer.strategy", "naive_ddp"))
    assert document["run"]["cli"] and document["calibration"]["fits"]["all_reduce"]["bandwidth_Bps"] > 0
    assert [r for r in document["recommendations"] if r["current"]][0]["strategy"] == "naive_ddp"


@pytest.mark.slow  # three more fits; the check itself is the advice benchmark (docs/advice.md)
def test_the_advice_runs_as_given_and_a_straggler_is_named(tmp_path: Path) -> None:
    document = _advise(_fit(tmp_path / "naive", "--trainer.strategy", "naive_ddp"))
    top = document["verdict"]["top"]
    if top is not None:  # a change: its fit_args run as they are
        run_cli("fit", *FAST, "--trainer.logger.init_args.save_dir", str(tmp_path / "applied"), *top["fit_args"],
                cwd=tmp_path)
    # 150 ms: most of the exposed time even when two loaded cores make the transfer itself slow
    slow = _advise(_fit(tmp_path / "slow", "--trainer.strategy", "bucketed_ddp",
                        "--trainer.callbacks+=lightning_ddp.callbacks.SlowRank", "--trainer.callbacks.rank", "1",
                        "--trainer.callbacks.delay_ms", "150"))
    assert slow["verdict"]["action"] == "straggler" and slow["verdict"]["straggler"]["rank"] == 1


@pytest.mark.slow  # advise end to end on a second model: the naive quickstart's run above stays in the default run
def test_advise_on_the_plain_lightning_example(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "measure_your_training.py")], cwd=tmp_path,
                          env=repo_first_on_path(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = (tmp_path / "logs").rglob("timing_summary.json")
    document = _advise(summary.parent)
    assert not document["run"]["cli"]
    for row in document["recommendations"]:
        assert row["fit_args"] == [] and row["python"].startswith("Trainer(strategy=")
