"""The CommTimer's TensorBoard views after two quickstart runs under one logger folder (2 CPU processes each): a
custom-scalars layout of the tags each run logged, and an HPARAMS table that tells the strategies apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_utils import REPO, run_cli
from tests.support.tensorboard_events import read_views

pytestmark = pytest.mark.multiprocess

# The quickstart cut to a small, fast cell (as tests/dist/test_comm_timer.py): ~10 s a run on 2 cores.
FAST = ("--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2",
        "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--timer.warmup_steps", "2")


@pytest.mark.slow  # two fits for the dashboards' end-to-end run, in the slow tier (`pytest -m slow`)
def test_two_strategies_get_one_layout_and_a_table_that_tells_them_apart(tmp_path: Path) -> None:
    strategies = ("naive_ddp", "bucketed_ddp")
    for strategy in strategies:  # one logger folder; an unnamed run is named by its strategy (logs/naive_ddp/...)
        run_cli("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), *FAST, "--trainer.strategy", strategy,
                "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), cwd=tmp_path)
    runs = [read_views(tmp_path / "logs" / strategy / "version_0") for strategy in strategies]
    for run in runs:
        charts = [[regex.removesuffix("$") for regex in chart]
                  for charts in run.layout.values() for chart in charts.values()]
        # Every tag a chart draws is one the run logged; 10 charts (LAYOUT) on two ranks with every comm/ key, 5 of
        # them combining several tags (step time with exposed and busy; share with overlap; exposed = wait +
        # transfer; lag with spread; bus with algorithm bandwidth). The run logs no reserved memory on CPU.
        assert all(tag in run.scalars for chart in charts for tag in chart), charts
        assert len(charts) == 10 and sum(len(chart) >= 2 for chart in charts) == 5, charts
        assert ["step/time_ms", "comm/exposed_ms", "comm/busy_ms"] in charts
        assert [run.hparams[f"run/{name}"] for name in ("world_size", "preset", "batch_size")] == [2, "tiny", 2]
        assert "median/step/time_ms" in run.metrics and "hp_metric" not in run.scalars  # no -1 placeholder
        # The table's step time: the median over the measured steps after warm-up (steps 2-5), logged once, at
        # the last step, and between the fastest and the slowest of those steps.
        ((step, median),) = run.scalars["median/step/time_ms"]
        times = [value for s, value in run.scalars["step/time_ms"] if s >= 2]
        assert step == 5 and min(times) <= median <= max(times), (median, times)
    naive, bucketed = runs
    names = ("grad_sync/strategy", "grad_sync/bucket_size_mb")
    # naive has no buckets; bucketed_ddp by name takes the default 25 MiB (the quickstart's own block says 2)
    assert [naive.hparams[name] for name in names] == ["naive_ddp", "n/a"]
    assert [bucketed.hparams[name] for name in names] == ["bucketed_ddp", 25.0]
    assert naive.scalars["median/step/time_ms"] != bucketed.scalars["median/step/time_ms"]
    # naive all-reduces after backward: nothing hidden; both runs list the same metrics, so one table holds both
    assert naive.scalars["median/comm/overlap"] == [(5, 0.0)] and naive.metrics == bucketed.metrics
