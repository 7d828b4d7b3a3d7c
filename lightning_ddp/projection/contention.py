"""Compute slowed while collectives run: the factor ``s`` per backend, its fit from the committed data
(``python -m lightning_ddp.projection.contention``: gloo on the CPU sweep, NCCL on the published runs) and the
before/after table both validations write."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning_ddp.projection.tables import markdown_table

CONTENTION: dict[str, float] = {"gloo": 1.0, "nccl": 0.36}
"""Fitted ``s`` per backend: what ``python -m lightning_ddp.projection.contention`` prints."""

CPU_COPY_GBPS = 24.03
"""Copy bandwidth of the CPU validation (GB/s read + written, measured once on the sweep's machine and recorded in
``benchmarks/results/projection/cpu_sweep_validation.md``); fixed so that the fit is reproducible anywhere."""

FIT_BATCH = 2
"""The fitting subset: cells with this per-rank batch size; the others are held out."""

S_MAX = 1.0
"""The largest ``s`` the fit considers: compute at half speed beside a collective (docs/projection.md)."""

GRID = (0.0, S_MAX, 0.05)
"""Coarse grid of ``s``: start, stop, step; refined to 0.01 around the best point (within ``[0, S_MAX]``)."""


def backend_contention(backend: str) -> float:
    """The fitted ``s`` of ``backend`` (``gloo``, ``nccl``); an unknown one names the known ones."""
    try:
        return CONTENTION[backend]
    except KeyError:
        raise ValueError(f"no fitted contention for backend {backend!r}; known: {', '.join(CONTENTION)} (or give "
                         "`network.contention` as a number)") from None


def fit_contention(loss: Callable[[float], float]) -> float:
    """The ``s`` of ``GRID`` (then 0.01 steps around the best) with the smallest ``loss(s)``, rounded to 0.01.

    >>> fit_contention(lambda s: (s - 0.37) ** 2)
    0.37
    """
    start, stop, step = GRID
    coarse = [start + k * step for k in range(int(round((stop - start) / step)) + 1)]
    best = min(coarse, key=loss)
    fine = [round(best + k * 0.01, 2) for k in range(-5, 6) if 0 <= best + k * 0.01 <= stop + 1e-9]
    return round(min(fine, key=loss), 2)


# ---- before and after, for the validation reports: rows with predicted_/measured_ step_ms and share ---------------


def _step_errors(rows: Sequence[dict[str, Any]]) -> list[float]:
    return [r["predicted_step_ms"] / r["measured_step_ms"] - 1 for r in rows]


def _share_errors(rows: Sequence[dict[str, Any]]) -> list[float]:
    return [abs(r["predicted_share"] - r["measured_share"]) for r in rows if r["measured_share"] is not None]


METRICS: dict[str, Callable[[Sequence[dict[str, Any]]], str]] = {
    "too fast": lambda rows: f"{sum(1 for e in _step_errors(rows) if e < 0)}/{len(rows)}",
    "median \\|step error\\|": lambda rows: f"{100 * statistics.median(map(abs, _step_errors(rows))):.1f} %",
    "mean \\|step error\\|": lambda rows: f"{100 * statistics.fmean(map(abs, _step_errors(rows))):.1f} %",
    "mean step error": lambda rows: f"{100 * statistics.fmean(_step_errors(rows)):+.1f} %",
    "mean \\|share error\\|": lambda rows: (f"{100 * statistics.fmean(_share_errors(rows)):.1f} pts"
                                        if _share_errors(rows) else "-"),
}
"""What the before -> after tables can show, by column title."""


def contention_lines(backend: str, s: float, fitted_on: str, before: Sequence[dict[str, Any]],
                     after: Sequence[dict[str, Any]], metrics: Sequence[str], by_strategy: bool) -> list[str]:
    """Markdown: ``metrics`` of the rows predicted without contention (``before``) -> with ``s`` (``after``, the same
    rows in the same order) on all rows, the fitting subset and the held-out rows (per strategy if ``by_strategy``)."""
    rows = []
    for subset, keep in (("all", lambda r: True), (f"fitting subset (batch {FIT_BATCH})",
                                                  lambda r: r["batch_size"] == FIT_BATCH),
                         ("held out (other batches)", lambda r: r["batch_size"] != FIT_BATCH)):
        for strategy in dict.fromkeys(r["strategy"] for r in before) if by_strategy else ["all"]:
            pairs = [(b, a) for b, a in zip(before, after) if keep(b) and strategy in ("all", b["strategy"])]
            was, now = [b for b, _ in pairs], [a for _, a in pairs]
            rows.append([subset, strategy, len(pairs), *(f"{METRICS[m](was)} -> {METRICS[m](now)}" for m in metrics)])
    return [
        "## Contention: compute slowed while collectives run", "",
        f"{backend}'s `s` = {s:g}, fitted on the batch-{FIT_BATCH} {fitted_on} (at most `S_MAX` = {S_MAX:g}; "
        "docs/projection.md, \"Contention\"). Before (s = 0) -> after:", "",
        *markdown_table(["subset", "strategy", "rows", *metrics], rows, "llr" + "r" * len(metrics)), "",
    ]


# ---- the fit: ``python -m lightning_ddp.projection.contention`` ----------------------------------------------------


def gloo_cells(sweep: str | Path, contention: float, copy_GBps: float = CPU_COPY_GBPS) -> list[dict[str, Any]]:
    """The CPU sweep's cells as ``validate.validate_cells`` predicts them with contention ``contention``."""
    from lightning_ddp.projection.validate import read_sweep, validate_cells  # validate reads this module

    rows, profiles, fit_path = read_sweep(sweep)
    return validate_cells(rows, profiles, fit_path, copy_GBps * 1e9, contention)


def _fit(rows_at: Callable[[float], list[dict[str, Any]]], error: Callable[[dict[str, Any]], float]) -> float:
    """The ``s`` minimising the mean ``error(row)`` over the batch-``FIT_BATCH`` rows of ``rows_at(s)``."""
    return fit_contention(lambda s: statistics.fmean(error(r) for r in rows_at(s) if r["batch_size"] == FIT_BATCH))


def fit_gloo(sweep: str | Path = "benchmarks/results/cpu", copy_GBps: float = CPU_COPY_GBPS) -> float:
    """``s`` for gloo: the squared log step-time error of the CPU sweep's cells."""
    return _fit(lambda s: gloo_cells(sweep, s, copy_GBps),
                lambda r: math.log(r["predicted_step_ms"] / r["measured_step_ms"]) ** 2)


def fit_nccl() -> float:
    """``s`` for NCCL: the squared wait-share error of the published runs on ``pcie_gen4``."""
    from lightning_ddp.projection.published import pcie_rows  # published reads this module

    return _fit(pcie_rows, lambda r: (r["predicted_share"] - r["measured_share"]) ** 2)


def main(sweep: str = "benchmarks/results/cpu") -> dict[str, float]:
    """Fit ``s`` per backend from the committed data and print it (paste it into ``CONTENTION``).

    Args:
        sweep: The CPU sweep directory (gloo's fit).
    """
    fitted = {"gloo": fit_gloo(sweep), "nccl": fit_nccl()}
    print(f"CONTENTION = {fitted!r}")
    if fitted != CONTENTION:
        print(f"(lightning_ddp/projection/contention.py holds {CONTENTION!r}: update it)", file=sys.stderr)
    return fitted


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, prog="python -m lightning_ddp.projection.contention")
