"""``python -m lightning_ddp.projection.contention``: fit the contention ``s`` per backend from the committed data
(gloo on the CPU sweep, NCCL on the published runs); paste what it prints into ``simulators.CONTENTION``."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.projection.published import pcie_rows
from lightning_ddp.projection.simulators import CONTENTION, CPU_COPY_GBPS
from lightning_ddp.projection.validate import FIT_BATCH, S_MAX, read_sweep, validate_cells


def fit_contention(loss: Callable[[float], float]) -> float:
    """The ``s`` in ``[0, S_MAX]`` with the smallest ``loss(s)``: a 0.05 grid, then 0.01 steps around its best.

    >>> fit_contention(lambda s: (s - 0.37) ** 2)
    0.37
    """
    best = min((k * 0.05 for k in range(int(round(S_MAX / 0.05)) + 1)), key=loss)
    fine = [round(best + k * 0.01, 2) for k in range(-5, 6) if 0 <= best + k * 0.01 <= S_MAX + 1e-9]
    return round(min(fine, key=loss), 2)


def _fit(rows_at: Callable[[float], list[dict[str, Any]]], error: Callable[[dict[str, Any]], float]) -> float:
    """The ``s`` minimising the mean ``error(row)`` over the batch-``FIT_BATCH`` rows of ``rows_at(s)``."""

    def mean_error(s: float) -> float:
        return statistics.fmean(error(row) for row in rows_at(s) if row["batch_size"] == FIT_BATCH)

    return fit_contention(mean_error)


def fit_gloo(sweep: str | Path = "benchmarks/results/cpu") -> float:
    """``s`` for gloo: the squared log step-time error of the CPU sweep's cells (``validate.validate_cells``)."""
    rows, profiles, fit_path = read_sweep(sweep)

    def cells_at(s: float) -> list[dict[str, Any]]:
        return validate_cells(rows, profiles, fit_path, CPU_COPY_GBPS * 1e9, s)

    def squared_log_error(row: dict[str, Any]) -> float:
        return math.log(row["predicted_step_ms"] / row["measured_step_ms"]) ** 2

    return _fit(cells_at, squared_log_error)


def fit_nccl() -> float:
    """``s`` for NCCL: the squared wait-share error of the published runs on ``pcie_gen4``."""

    def squared_share_error(row: dict[str, Any]) -> float:
        return (row["predicted_share"] - row["measured_share"]) ** 2

    return _fit(pcie_rows, squared_share_error)


def main(sweep: str = "benchmarks/results/cpu") -> dict[str, float]:
    """Fit ``s`` per backend from the committed data and print it (paste it into ``CONTENTION``).

    Args:
        sweep: The CPU sweep directory (gloo's fit).
    """
    fitted = {"gloo": fit_gloo(sweep), "nccl": fit_nccl()}
    print(f"CONTENTION = {fitted!r}")
    if fitted != CONTENTION:
        print(f"(lightning_ddp/projection/simulators.py holds {CONTENTION!r}: update it)", file=sys.stderr)
    return fitted


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, prog="python -m lightning_ddp.projection.contention")
