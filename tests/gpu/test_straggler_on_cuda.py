"""Straggler attribution on CUDA: launch times from CUDA events on one axis per rank, a SlowRank that synchronizes.

Two ranks share the one GPU over gloo (``tests.support.fits``: NCCL refuses two ranks on one GPU), so launches are
CUDA events converted through each rank's anchor and compared on the host clock both ranks share.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.support.fits import check_step_rows, fit_one_device, strategy_json

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

BF16 = ("--trainer.precision", "bf16-mixed")


def test_straggler_keys_at_nccl_world_size_1(tmp_path: Path) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json("bucketed_ddp", "nccl"), *BF16)
    check_step_rows(summary)
    for row in summary["steps"]:  # one rank: nobody to wait for, the straggler is itself with no lag
        assert row["comm/wait_ms"] == 0.0 and row["comm/transfer_ms"] == pytest.approx(row["comm/exposed_ms"])
        assert (row["straggler/rank"], row["straggler/lag_ms"], row["step/rank_spread_ms"]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "ddp"])
def test_an_injected_straggler_on_two_ranks_sharing_one_gpu(tmp_path: Path, strategy: str) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json(strategy, "gloo"), *BF16,
                             "--trainer.callbacks+=lightning_ddp.callbacks.SlowRank", "--trainer.callbacks.rank", "1",
                             "--trainer.callbacks.delay_ms", "50", ranks=2)
    check_step_rows(summary)
    measured = summary["steps"][summary["warmup_steps"]:]
    # rank 1 synchronizes, then sleeps 50 ms before backward: its device is idle that long and its buckets launch
    # ~50 ms after rank 0's (loose bounds: two ranks time-slice one GPU)
    assert 30 < statistics.median(row["comm/wait_ms"] for row in measured) < 90
    assert sum(row["straggler/rank"] == 1 for row in measured) >= 0.8 * len(measured)
