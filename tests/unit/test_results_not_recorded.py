"""results.csv's "not recorded": only a cell measured by its landmarks alone (fsdp2) says it; the one-device reference
cell, which has no communication and so no ``comm/`` key at all, leaves those cells empty."""

from __future__ import annotations

import pytest

from lightning_ddp.bench.report import CellData, cell_row
from lightning_ddp.bench.stats import Bootstrapper
from lightning_ddp.metrics.accounting import NOT_RECORDED


def _cell(step_keys: dict[str, float]) -> CellData:
    repeat = {"repeat": 0, "status": "ok", "reason": "", "wall_s": 1.0}
    steps = [{"step": i, "step/time_ms": 100.0 + i, **step_keys} for i in range(4)]
    return CellData("cell", {"strategy": "x"}, repeats=[repeat], steps={0: steps})


@pytest.mark.parametrize(
    "step_keys, expected",
    [
        ({"comm/exposed_ms": 10.0, "comm/share": 0.1, "comm/clock_anomalies": 0.0}, NOT_RECORDED),  # fsdp2
        ({}, ""),  # the one-device reference: nothing to record, nothing "not recorded"
    ],
)
def test_only_landmark_cells_say_not_recorded(step_keys: dict[str, float], expected: str) -> None:
    row = cell_row(_cell(step_keys), Bootstrapper(50, seed=0))
    assert row["busy_comm_ms"] == row["overlap"] == expected
