"""Compute slowed while collectives run: the contention factor ``s`` per backend, the grid fit that gives it, and the
before/after table both validations write (rows of predicted and measured step times and shares).

``CONTENTION`` holds what ``python -m lightning_ddp.projection.contention_fit`` prints (``test_project.py`` refits it).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from lightning_ddp.projection.tables import markdown_table

CONTENTION: dict[str, float] = {"gloo": 1.0, "nccl": 0.36}
"""Fitted ``s`` per backend (``python -m lightning_ddp.projection.contention_fit`` prints them)."""

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
