"""results.csv's communication cells: filled from a cell's recorded collectives (every strategy's, fsdp2's too, since
the timer records at the process group); left empty for the one-device reference cell, which has no communication
and so no ``comm/`` key at all."""

from __future__ import annotations

import pytest

from lightning_ddp.bench.report import CellData, cell_row
from lightning_ddp.bench.stats import Bootstrapper


def _cell(step_keys: dict[str, float]) -> CellData:
    repeat = {"repeat": 0, "status": "ok", "reason": "", "wall_s": 1.0}
    steps = [{"step": i, "step/time_ms": 100.0 + i, **step_keys} for i in range(4)]
    return CellData("cell", {"strategy": "x"}, repeats=[repeat], steps={0: steps})


@pytest.mark.parametrize(
    "step_keys, expected",
    [
        ({"comm/exposed_ms": 10.0, "comm/share": 0.1, "comm/busy_ms": 12.0, "comm/overlap": 0.25}, (12.0, 0.25)),
        ({}, ("", "")),  # the one-device reference: nothing communicated, nothing to show
    ],
)
def test_communication_cells_come_from_the_recorded_keys(step_keys: dict[str, float], expected: tuple) -> None:
    row = cell_row(_cell(step_keys), Bootstrapper(50, seed=0))
    assert (row.get("busy_comm_ms", ""), row.get("overlap", "")) == expected
